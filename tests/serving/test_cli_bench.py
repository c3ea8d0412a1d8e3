"""`matrixinfer serve` as users start it (a subprocess), and `matrixinfer bench serve` against
it: Poisson single-turn load and multi-turn conversations, written to benchmarks/."""

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from matrixinfer.bench.serve_bench import _free_port
from matrixinfer.cli import main as cli_main


@pytest.fixture(scope="module")
def served(text_checkpoint, tmp_path_factory):
    """`matrixinfer serve` in a subprocess on a free port with an empty key database."""
    port = _free_port()
    db = tmp_path_factory.mktemp("cli") / "serving.db"
    proc = subprocess.Popen([sys.executable, "-m", "matrixinfer.cli", "serve", "--model", str(text_checkpoint[0]),
                             "--port", str(port), "--keys-db", str(db), "--dtype", "float32", "--block-size", "4",
                             "--served-model-name", "tiny"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        yield url, proc, db
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_without_keys_says_so(served):
    """With no keys configured the server answers anyone and said so on start."""
    url, proc, _ = served
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
    proc.terminate()  # read what it printed; the fixture's terminate is then a no-op
    assert "WITHOUT authentication" in proc.communicate(timeout=30)[1]


def test_bench_serve_single_and_multi_turn(text_checkpoint, tmp_path, monkeypatch, capsys):
    """bench serve (starting its own server on --model) completes every request at each rate,
    reports TTFT/TPOT percentiles and throughput, writes JSON, a plot and its BENCHMARKS.md
    section to ./bench-results/ (benchmarks/ untouched) or, with --save, to benchmarks/;
    multi-turn mode sees later turns hit the prefix cache."""
    monkeypatch.chdir(tmp_path)
    common = ["bench", "serve", "--model", str(text_checkpoint[0]), "--dtype", "float32", "--input-len", "8",
              "--output-len", "4", "--json"]
    assert cli_main(common + ["--rates", "8", "16", "--num-requests", "4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["completed"] for r in report["results"]] == [4, 4]
    r = report["results"][0]
    assert r["ttft_p50_s"] > 0 and r["tpot_p99_s"] > 0 and r["output_tok_s"] > 0
    assert r["output_tokens"] == 16
    assert (tmp_path / "bench-results" / "serve.json").exists() and not (tmp_path / "benchmarks").exists()
    assert cli_main(common + ["--rates", "4", "--multi-turn", "--conversations", "2", "--turns", "3", "--save"]) == 0
    multi = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"][0]
    assert multi["completed"] == 6 and multi["cached_fraction"] > 0
    for name in ["serve-multiturn.json", "serve-multiturn.png"]:
        assert (tmp_path / "benchmarks" / name).exists(), name
    assert (tmp_path / "bench-results" / "serve.png").exists()
    md = (tmp_path / "benchmarks" / "BENCHMARKS.md").read_text()
    assert "<!-- bench:serve -->" in md and "multi-turn" in md
