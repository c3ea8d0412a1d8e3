"""The corpus: the running interpreter's standard library sources (`Lib/**/*.py`), without
tests, IDLE, site-packages and generated files. Held-out files are a fixed list committed in
data/heldout_files.txt (paths relative to the stdlib root)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HELDOUT_LIST = REPO / "data" / "heldout_files.txt"
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Relative paths (posix, sorted) of every stdlib .py file that belongs to the corpus."""
    root = root or stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):  # generated at build time
            continue
        out.append(rel.as_posix())
    return sorted(out)


def choose_heldout(files: list[str], fraction: float = 0.04) -> list[str]:
    """How the committed list was drawn: a stable hash of the path, not a random generator."""
    def h(name: str) -> float:
        return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 16**8
    return [f for f in files if h(f) < fraction]


def read_heldout_list(path: Path = HELDOUT_LIST) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def split(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(train files, held-out files) present under this interpreter's stdlib."""
    files = corpus_files(root)
    held = set(read_heldout_list())
    return [f for f in files if f not in held], [f for f in files if f in held]


def read_texts(files: list[str], root: Path | None = None) -> list[str]:
    root = root or stdlib_root()
    return [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]
