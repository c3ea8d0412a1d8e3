"""Rebuild models/matrixinfer-tiny-moe from scratch: train (`matrixinfer train-tiny`), then
evaluate and write the model card (`matrixinfer eval-tiny`). The shipped model was made with

    python scripts/train_tiny.py --threads 1

(one thread: on a 2-core machine shared with other jobs, two OpenMP threads ran 3-5x slower).

Extra arguments go to train-tiny (see `python -m matrixinfer.train.cli train-tiny --help`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from matrixinfer.train.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[args.index("--out") + 1] if "--out" in args else None
    threads = args[args.index("--threads") + 1] if "--threads" in args else "2"
    main(["train-tiny", *args])
    sys.exit(main(["eval-tiny", "--threads", threads, *(["--model", out] if out else [])]))
