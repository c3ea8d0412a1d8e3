"""`matrixinfer bench spec` on a tiny setting: the same requests with and without MTP drafts,
acceptance counted, greedy outputs compared, results written to --out."""

import json

import pytest

from matrixinfer.cli import main as cli_main


def test_bench_spec_compares_the_same_requests_with_and_without_drafts(tmp_path, capsys):
    out = tmp_path / "results"
    assert cli_main(["bench", "spec", "--out", str(out), "--batches", "1", "2", "--num-speculative-tokens", "1",
                     "--input-len", "16", "--output-len", "8", "--repeats", "1", "--json"]) == 0
    points = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(p["batch"], p["k"]) for p in points] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(p["identical_to_no_spec"] for p in points)
    for p in points:
        if p["k"]:
            assert 0 < p["acceptance_rate"] <= 1 and p["tokens_per_step"] == pytest.approx(1 + p["acceptance_rate"])
        assert p["decode_tokens_per_s"] > 0 and p["tpot_ms"] > 0
    assert "## Speculative decoding" in (out / "BENCHMARKS.md").read_text() and (out / "spec.png").exists()
