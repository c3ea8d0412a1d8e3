"""The engine's command line: `matrixinfer generate` and `matrixinfer bench engine --json`."""

import json
import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "matrixinfer.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_prompt_and_completion(text_checkpoint):
    out = run_cli("generate", "--model", str(text_checkpoint[0]), "--prompt", "def add", "--max-tokens", "8",
                  "--ignore-eos", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def add") and len(out.stdout.strip()) > len("def add")


def test_generate_missing_model_is_a_clear_error(tmp_path):
    out = run_cli("generate", "--model", str(tmp_path), "--prompt", "x")
    assert out.returncode != 0 and "config.json" in out.stderr


def test_bench_engine_json_last_line(text_checkpoint):
    """The benchmark runs our engine compiled and eager and transformers on the same requests
    and ends with one JSON object (the engine's limits kept small: they size the compile)."""
    out = run_cli("bench", "engine", "--model", str(text_checkpoint[0]), "--requests", "2", "--input-len", "8",
                  "--output-len", "4", "--no-write", "--no-profile", "--threads", "1", "--repeats", "1", "--json",
                  "--max-num-seqs", "4", "--max-num-batched-tokens", "32")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["matrixinfer_tokens_per_s"] > 0 and result["transformers_tokens_per_s"] > 0
    assert result["eager_tokens_per_s"] > 0 and result["compile_s"] > 0
    assert abs(result["compiled_over_eager"] - result["matrixinfer_tokens_per_s"] / result["eager_tokens_per_s"]) < 1e-6
    assert result["ratio"] == result["matrixinfer_tokens_per_s"] / result["transformers_tokens_per_s"] or \
        abs(result["ratio"] - result["matrixinfer_tokens_per_s"] / result["transformers_tokens_per_s"]) < 1e-6


def test_generate_with_sp_tp_sp_prefill_prints_what_one_process_prints(text_checkpoint):
    args = ("generate", "--model", str(text_checkpoint[0]), "--prompt", "def add", "--max-tokens", "8",
            "--ignore-eos", "--dtype", "float32", "--temperature", "0")
    one = run_cli(*args)
    sp = run_cli(*args, "--prefill-parallel", "sp-tp-sp", "--prefill-parallel-size", "2")
    assert one.returncode == 0 and sp.returncode == 0, sp.stderr[-2000:]
    assert sp.stdout == one.stdout
