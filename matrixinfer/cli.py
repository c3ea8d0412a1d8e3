"""`matrixinfer` command line: each subsystem registers its own subcommands.

A subsystem module exposes `register(sub, bench_sub)`: `sub` is the top-level subparsers
object, `bench_sub` the one under `matrixinfer bench`. Each parser sets `func=` to the
function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBSYSTEMS = [
    "matrixinfer.frontend.cli",
    "matrixinfer.sim.cli",
    "matrixinfer.ems.cli",
    "matrixinfer.serving.cli",
    "matrixinfer.train.cli",
    "matrixinfer.quant.cli",
    "matrixinfer.bench.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="matrixinfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks; results go to --out (./bench-results/) or, with --save, benchmarks/")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name in SUBSYSTEMS:
        importlib.import_module(name).register(sub, bench_sub)
    from matrixinfer.bench.report import add_output_args

    for bench_parser in bench_sub.choices.values():  # every benchmark: --out DIR / --save
        add_output_args(bench_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from matrixinfer.bench.report import configure

        configure(args.out, args.save)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:  # bad input: a clear message, not a traceback
        print(f"matrixinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
