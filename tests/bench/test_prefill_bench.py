"""`matrixinfer bench prefill` end to end on a tiny setting (2 ranks, one batch, one run),
writing to --out; and its pure parts: the heavy-tailed lengths and the 16-die projection."""

import json

import pytest

from matrixinfer.bench.prefill_bench import heavy_tailed_lengths, projection
from matrixinfer.cli import main as cli_main


def test_lengths_are_heavy_tailed_within_bounds():
    lengths = heavy_tailed_lengths(400, seed=0, shortest=16, longest=512)
    assert min(lengths) >= 16 and max(lengths) <= 512
    lengths.sort()
    assert lengths[len(lengths) // 2] < 64 and lengths[-len(lengths) // 20] > 256  # many short, a few long


def test_projection_puts_sp_tp_sp_ahead_of_dp_and_tp_on_mixed_lengths():
    rows = projection(heavy_tailed_lengths(64, seed=0, shortest=256, longest=32768), devices=16)
    by = {r["layout"]: r for r in rows[:3]}
    assert by["sp-tp-sp"]["batch_s"] < min(by["dp"]["batch_s"], by["tp"]["batch_s"])
    assert rows[3]["dp_balance"] < 1


@pytest.mark.slow
def test_bench_prefill_writes_every_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    assert cli_main(["bench", "prefill", "--out", str(out), "--ranks", "2", "--batches", "1", "--prompts", "4",
                     "--longest", "64", "--repeats", "1", "--sim-prompts", "8", "--microbatches"]) == 0
    report = json.loads((out / "prefill.json").read_text())
    assert [(r["layout"], r["ranks"]) for r in report["results"]] == [
        ("one process", 1), ("dp", 2), ("tp", 2), ("sp-tp-sp", 2), ("sp-tp-sp (2 microbatches)", 2)]
    assert all(r["tokens_per_s"] > 0 and r["balance"] >= 1 for r in report["results"])
    assert report["results"][0]["mb_sent_per_rank"] == 0 and all(r["mb_sent_per_rank"] > 0
                                                                for r in report["results"][1:])
    assert len(report["overlap"]) == 1 and report["overlap"][0].startswith("- 2 ranks: time in collectives")
    assert (out / "prefill.png").exists() and "bench:prefill" in (out / "BENCHMARKS.md").read_text()
    assert not (tmp_path / "benchmarks").exists()
