"""`matrixinfer bench pdc` end to end on a tiny setting: three real `matrixinfer serve`
processes (colocated, PDC least-loaded, PDC locality) get the same requests."""

import json

import pytest

from matrixinfer.cli import main as cli_main


@pytest.mark.slow
def test_bench_pdc_runs_every_system_on_the_same_load(tmp_path, monkeypatch, capsys):
    """Every point of every system completes; the report has the cache on/off comparison,
    the hand-off gap and the simulator's prediction of the same configuration; results go
    to --out (benchmarks/ untouched)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    assert cli_main(["bench", "pdc", "--out", str(out), "--rates", "8", "--reuse", "0", "0.5", "--num-requests", "2",
                     "--conversations", "1", "--turns", "2", "--input-len", "32", "--output-len", "3",
                     "--turn-len", "8", "--sim-requests", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["system"] for s in report["systems"]] == ["colocated", "pdc least-loaded", "pdc locality"]
    scenarios = ["single-turn 0% reuse", "single-turn 50% reuse", "single-turn 50% reuse, cache off", "multi-turn"]
    for s in report["systems"]:
        assert [r["scenario"] for r in s["results"]] == scenarios
        assert all(r["failed"] == 0 and r["completed"] == r["requests"] for r in s["results"])
        assert all(r["ttft_p50_s"] > 0 and r["first_gap_p50_s"] is not None for r in s["results"])
        off = next(r for r in s["results"] if not r["cache"])
        assert off["cached_fraction"] == 0  # a tenant per request: nothing reused
    assert {c["system"] for c in report["cache_effect"]} == {s["system"] for s in report["systems"]}
    assert len(report["handoff"]) == 3
    assert [sim["file"] for sim in report["simulator"]] == ["pdc.yaml", "pdc-at-scale.yaml"]
    assert all(sim["serve"]["finished"] == 20 for sim in report["simulator"])
    assert {p.name for p in out.iterdir()} >= {"pdc.json", "pdc.png", "pdc.yaml", "pdc-at-scale.yaml", "BENCHMARKS.md"}
    assert "<!-- bench:pdc -->" in (out / "BENCHMARKS.md").read_text()
    assert not (tmp_path / "benchmarks").exists()
