"""`python -m matrixinfer.ems controller|server|...`: the EMS roles without importing the rest
of matrixinfer (a server process starts in a fraction of a second)."""

import argparse
import sys

from .cli import register


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrixinfer.ems")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, argparse.ArgumentParser().add_subparsers())  # the roles only: `matrixinfer bench ems` is bench/'s
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parser.parse_args(["ems", *argv])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
