"""Rebuild models/matrixinfer-tiny-moe from scratch: train (`matrixinfer train-tiny`), then
evaluate and write the model card (`matrixinfer eval-tiny`). The shipped model was made with

    python scripts/train_tiny.py --steps 900 --batch-size 8 --seq-len 512 --threads 1

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
