# Two entry points (see README): `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/matrixinfer serve

# two pytest workers, one test file each at a time: the tests run torch on one thread each
# (tests/conftest.py), so one worker left a core idle
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

.PHONY: install serve test
