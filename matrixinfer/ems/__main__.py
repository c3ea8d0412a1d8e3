"""`python -m matrixinfer.ems controller|server|...`: the EMS roles without importing the rest
of matrixinfer (a server process starts in a fraction of a second)."""

import argparse
import sys

from .cli import register


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrixinfer.ems")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench")
    register(sub, bench.add_subparsers(dest="bench_command", required=True))
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parser.parse_args(argv if argv[:1] == ["bench"] else ["ems", *argv])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
