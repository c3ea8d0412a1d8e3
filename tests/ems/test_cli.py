"""The `matrixinfer ems` command line."""

import argparse
import subprocess
import sys

import pytest

from matrixinfer.bench.cli import _register_ems
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
    _register_ems(bench)
    for argv in (["ems", "controller"], ["ems", "server", "--controller", "h:1", "--ssd-dir", "d"],
                 ["ems", "model-load", "--model", "d", "--direct"], ["ems", "source", "--model", "d"],
                 ["ems", "stats", "--controller", "h:1"], ["ems", "ns-create", "--controller", "h:1", "--name", "n"],
                 ["ems", "ns-list", "--controller", "h:1"], ["bench", "ems", "--quick"],
                 ["bench", "ems", "--replicas", "2"]):
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


@pytest.mark.timeout(60)
def test_ns_create_sets_replicas_and_quotas_that_ns_list_shows(tmp_path, request):
    """`ems ns-create --replicas 2 --dram-bytes 64M` against a real controller; `ems ns-list`
    prints the namespace with them; a bad count exits non-zero with the controller's reason."""
    import json

    from matrixinfer.ems import LocalCluster

    cl = LocalCluster(n_servers=0, root=str(tmp_path))
    request.addfinalizer(cl.close)
    cl.start()
    ems = [sys.executable, "-m", "matrixinfer.ems"]
    out = subprocess.run([*ems, "ns-create", "--controller", cl.controller, "--name", "kv", "--replicas", "2",
                          "--dram-bytes", "64M"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout) == {"name": "kv", "created": True, "replicas": 2}
    listed = json.loads(subprocess.run([*ems, "ns-list", "--controller", cl.controller], capture_output=True,
                                       text=True, timeout=30).stdout)
    assert (listed["kv"]["replicas"], listed["kv"]["dram_bytes"]) == (2, 64 << 20)
    bad = subprocess.run([*ems, "ns-create", "--controller", cl.controller, "--name", "kv", "--replicas", "0"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "replicas" in bad.stderr
