import os

import pytest
import torch

# Engines in tests run eagerly unless a test asks for the compiled decode step (it costs tens
# of seconds of compiling per engine on two cores); set before any engine process is spawned.
os.environ.setdefault("MATRIXINFER_ENFORCE_EAGER", "1")

from tests.hf_fixtures import VARIANTS, make_checkpoint, make_tokenizer

# One intra-op thread: tests start server subprocesses beside this one on small CI machines, and
# OpenMP threads spinning against busy cores cost far more than they gain on tiny models.
torch.set_num_threads(1)


@pytest.fixture(scope="session", params=list(VARIANTS))
def hf_checkpoint(request, tmp_path_factory):
    """(directory, transformers model) for each tiny random variant."""
    path = tmp_path_factory.mktemp(request.param)
    return path, make_checkpoint(path, request.param)


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """A V3 checkpoint with a real byte-level BPE tokenizer (vocab 300), for text-level tests."""
    path = tmp_path_factory.mktemp("text-model")
    make_tokenizer(path, vocab_size=300)
    model = make_checkpoint(path, "v3-qlora-yarn", vocab_size=300, eos_token_id=1)
    return path, model
