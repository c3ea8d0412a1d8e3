"""The `matrixinfer ems` command line."""

import argparse
import subprocess
import sys

import pytest

from matrixinfer.ems.cli import parse_bytes, register


def test_sizes_accept_units_and_reject_garbage():
    """--dram-bytes takes 512M / 4G / 64KiB / plain bytes; anything else is a clear error."""
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("4G") == 4 << 30
    assert parse_bytes("64KiB") == 64 << 10 and parse_bytes("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_bytes("lots")


def test_every_subcommand_is_registered_with_a_function():
    """ems controller/server/model-load/source/stats and bench ems parse and set func."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command")
    register(sub, bench)
    for argv in (["ems", "controller"], ["ems", "server", "--controller", "h:1", "--ssd-dir", "d"],
                 ["ems", "model-load", "--model", "d", "--direct"], ["ems", "source", "--model", "d"],
                 ["ems", "stats", "--controller", "h:1"], ["bench", "ems", "--quick"]):
        assert callable(parser.parse_args(argv).func)


def test_server_with_unreachable_ssd_dir_fails_with_a_message(tmp_path):
    """A server that cannot create its SSD directory exits non-zero and says why."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = subprocess.run([sys.executable, "-m", "matrixinfer.ems", "server", "--controller", "127.0.0.1:1",
                        "--ssd-dir", str(blocker / "sub")], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "sub" in p.stderr


def test_the_matrixinfer_command_has_the_ems_subcommands():
    """`matrixinfer ems server --help` works through the top-level CLI (registration)."""
    p = subprocess.run([sys.executable, "-m", "matrixinfer.cli", "ems", "server", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--dram-bytes" in p.stdout
