"""`matrixinfer bench ep` end to end on a tiny setting (EP 2, one call per row), writing to
--out: every section is there and the row format keeps INT8 at most 0.55 of BF16."""

import json

import pytest

from matrixinfer.cli import main as cli_main


@pytest.mark.slow
def test_bench_ep_writes_every_section(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    assert cli_main(["bench", "ep", "--out", str(out), "--ep", "2", "--tokens", "4", "--iters", "1",
                     "--requests", "0"]) == 0
    report = json.loads((out / "ep.json").read_text())
    assert {r["dtype"] for r in report["comm"]} == {"int8", "bfloat16"}
    assert report["int8_bf16_ratio"] <= 0.55
    assert all(r["after"] <= r["before"] + 1e-9 for r in report["eplb_real"] + report["eplb_zipf"])
    assert [r["mode"] for r in report["overlap"]] == ["serial", "2 microbatches"]
    assert set(report["projection"]["comm"]) == {"int8", "bf16"}
    assert (out / "ep.png").exists() and "bench:ep" in (out / "BENCHMARKS.md").read_text()
    assert not (tmp_path / "benchmarks").exists()
