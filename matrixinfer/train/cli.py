"""`matrixinfer train-tiny` (train the shipped model) and `matrixinfer eval-tiny` (held-out
metrics, training curve and model card). Also runnable as `python -m matrixinfer.train.cli`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _train(args) -> int:
    from matrixinfer.train.tiny import TrainConfig, run

    tc = TrainConfig(seed=args.seed, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     lr=args.lr, threads=args.threads, save_every=args.save_every, eval_every=args.eval_every,
                     bias_update_speed=args.bias_update_speed, mtp_weight=args.mtp_weight,
                     autocast_bf16=not args.fp32)
    run(Path(args.out), tc, vocab_size=args.vocab_size)
    return 0


def _eval(args) -> int:
    from matrixinfer.train.evaluate import evaluate_and_write_card

    evaluate_and_write_card(Path(args.model), threads=args.threads, max_windows=args.max_windows)
    return 0


def _distill(args) -> int:
    from matrixinfer.train.distill import run

    r = run(Path(args.model), Path(args.out), args.steps, args.batch_size, args.seq_len, args.lr, args.threads)
    print(f"MTP agreement with the main model's next-next token (held-out): {r['before']:.4f} -> {r['after']:.4f}; "
          f"{r['replaced_tensors']} MTP tensors rewritten into {args.out}")
    return 0


def register(sub, bench_sub) -> None:
    from matrixinfer.train.tiny import DEFAULT_OUT, TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-tiny", help="train the small DeepSeek-V3-architecture model on the stdlib sources")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output Hugging Face directory")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--bias-update-speed", type=float, default=d.bias_update_speed, help="gamma of the bias-update rule")
    p.add_argument("--mtp-weight", type=float, default=d.mtp_weight)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.set_defaults(func=_train)

    m = sub.add_parser("distill-mtp", help="self-distil the MTP module (main model frozen) towards the main "
                       "model's own next-next token; writes a copy of the model with only the MTP tensors changed")
    m.add_argument("--model", default=str(DEFAULT_OUT))
    m.add_argument("--out", required=True, help="output model directory (a copy of --model)")
    m.add_argument("--steps", type=int, default=300)
    m.add_argument("--batch-size", type=int, default=8)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--lr", type=float, default=5e-4)
    m.add_argument("--threads", type=int, default=1)
    m.set_defaults(func=_distill)

    e = sub.add_parser("eval-tiny", help="held-out metrics of the tiny model; writes eval.json, the curve and README.md")
    e.add_argument("--model", default=str(DEFAULT_OUT))
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--max-windows", type=int, default=None, help="score only the first N held-out windows")
    e.set_defaults(func=_eval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrixinfer.train.cli")
    register(parser.add_subparsers(dest="command", required=True), None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
