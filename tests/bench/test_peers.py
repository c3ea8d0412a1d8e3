"""`bench engine --peers` plumbing without the peers themselves (they are never installed for the
test suite): a stand-in interpreter answers the runner's JSON protocol, so these tests prove the
job the bench sends, how greedy agreement is counted, that a failing or hanging peer is a clear
error, and how a peers folder is discovered. The real llama.cpp / vLLM runs are the benchmark's
(benchmarks/BENCHMARKS.md, "engine")."""

import json
import stat
import sys
from pathlib import Path

import pytest

from matrixinfer.bench.peers import Peers, run_peer, vllm_overrides


def _fake_python(tmp_path, body: str):
    """An executable that stands in for a peer's interpreter: it gets the runner's path as its
    argument and the job on stdin, and runs `body` (Python) with `job` bound."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\nimport json, sys, time\njob = json.load(sys.stdin)\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_peer_job_and_greedy_agreement(tmp_path):
    """The peer gets the same prompts, output length and threads; agreement is counted position by
    position against our tokens, and a request counts as identical only when all of it matches."""
    py = _fake_python(tmp_path, "\n".join([
        "assert job['output_len'] == 3 and job['threads'] == 2 and job['gguf'] == 'm.gguf'",
        "assert job['prompts'] == [[5, 6], [7, 8]] and job['warm_prompts'] == [[9, 9], [9, 9]]",
        "print('some log line')",
        "print(json.dumps({'engine': 'fake', 'seconds': 0.5, 'tokens': [[1, 2, 3], [1, 9, 3]]}))",
        "print('INFO shutdown: a log line after the answer, as vLLM prints on exit')",
    ]))
    peers = Peers(llama_python=py, gguf="m.gguf")
    r = run_peer("llama.cpp", peers, "unused", "float32", 2, [[5, 6], [7, 8]], [[9, 9], [9, 9]], 3, 4096,
                 ours=[[1, 2, 3], [1, 2, 3]], cache_dir=tmp_path)
    assert r.engine == "fake" and r.tokens_per_s == pytest.approx(2 * 3 / 0.5)
    assert r.greedy_agreement == pytest.approx(5 / 6) and r.requests_identical == pytest.approx(0.5)


def test_failing_or_hanging_peer_is_a_clear_error(tmp_path):
    bad = Peers(llama_python=_fake_python(tmp_path, "sys.exit('no model here')"), gguf="m.gguf")
    with pytest.raises(RuntimeError, match="llama.cpp failed .*no model here"):
        run_peer("llama.cpp", bad, "unused", "float32", 1, [[5]], [[6]], 1, 10, [[1]], tmp_path)
    slow = Peers(vllm_python=_fake_python(tmp_path, "time.sleep(30)"), timeout_s=1)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(RuntimeError, match="did not finish in 1 s"):
        run_peer("vLLM", slow, str(tmp_path), "float32", 1, [[5]], [[6]], 1, 10, [[1]], tmp_path)


def test_llama_cpp_without_gguf_or_converter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="llama.cpp needs a GGUF"):
        run_peer("llama.cpp", Peers(llama_python=sys.executable), "unused", "float32", 1, [[5]], [[6]], 1, 10, [[1]],
                 tmp_path)


def test_peers_folder_discovery(tmp_path):
    """The shared/peers layout: venvs by name, the converter inside an unpacked llama-cpp-python
    sdist; explicit paths win; a folder with no peer is refused."""
    for venv in ("venv_llama", "venv_vllm"):
        (tmp_path / venv / "bin").mkdir(parents=True)
        (tmp_path / venv / "bin" / "python").write_text("")
    src = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    p = Peers.from_dir(str(tmp_path), vllm_python="/opt/vllm/python")
    assert p.llama_python == str(tmp_path / "venv_llama" / "bin" / "python")
    assert p.vllm_python == "/opt/vllm/python" and p.llama_cpp_src == str(src)
    assert p.engines() == ["llama.cpp", "vLLM"]
    with pytest.raises(ValueError, match="holds neither"):
        Peers.from_dir(str(tmp_path / "llama_cpp_python-0.3.36"))


def test_vllm_overrides_for_deepseek_configs(tmp_path):
    """transformers 5 drops V3's routing keys, which vLLM reads; its CPU MLA kernel takes only 512 + 64."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 64,
                                                      "qk_rope_head_dim": 16}))
    assert vllm_overrides(str(tmp_path)) == ({"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                                             {"VLLM_MLA_DISABLE": "1"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512,
                                                      "qk_rope_head_dim": 64, "scoring_func": "softmax"}))
    assert vllm_overrides(str(tmp_path)) == ({"scoring_func": "softmax", "topk_method": "noaux_tc"}, {})


def test_report_with_peers_writes_named_files(tmp_path, monkeypatch):
    """`bench engine --name N` with peers writes N.json, N.png, N-peers.png and a section that
    links them (a loop variable once shadowed the name and the plot went elsewhere)."""
    from dataclasses import fields

    from matrixinfer.bench import report as rep
    from matrixinfer.bench.engine_bench import EngineBenchResult, report

    monkeypatch.setattr(rep, "BENCH_DIR", tmp_path)
    base = {f.name: 1.0 for f in fields(EngineBenchResult)}
    base.update(model="m", dtype="float32", threads=2, input_len=8, output_len=4, repeats=1, profile_top_ops=[],
                eager_profile_top_ops=[], cpu={"cpu": "x", "torch_cpu_capability": "AVX2", "amx": [], "avx512_vnni": False})
    peer = {"engine": "llama.cpp (x)", "tokens_per_s": 2.0, "seconds": 1.0, "greedy_agreement": 1.0,
            "requests_identical": 1.0}
    results = [EngineBenchResult(**{**base, "requests": n, "peers": [peer]}) for n in (1, 8)]
    report(results, "engine-x")
    assert {p.name for p in tmp_path.iterdir()} >= {"engine-x.json", "engine-x.png", "engine-x-peers.png",
                                                    "BENCHMARKS.md"}
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "](engine-x.png)" in md and "](engine-x-peers.png)" in md and "llama.cpp (x)" in md


def test_gguf_cache_is_keyed_by_the_checkpoint_not_its_folder_name(tmp_path, monkeypatch):
    """Two checkpoints in folders of the same name, or one rewritten, never share a converted
    GGUF; the same unchanged checkpoint converts once."""
    import matrixinfer.bench.peers as peers_mod

    calls = []

    def fake_convert(cmd, stdin, timeout, what, env=None):
        calls.append(cmd[3])
        open(cmd[-1], "w").write("gguf")
        return ""

    monkeypatch.setattr(peers_mod, "_run", fake_convert)
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    (b / "config.json").write_text('{"other": 1}')
    p = Peers(llama_python="x", llama_cpp_src="src")
    cache = tmp_path / "cache"
    first, again = peers_mod.gguf_for(p, str(a), "float32", cache), peers_mod.gguf_for(p, str(a), "float32", cache)
    other = peers_mod.gguf_for(p, str(b), "float32", cache)
    assert first == again and other != first and len(calls) == 2


def test_vllm_server_command_serves_our_model_name_with_its_cpu_setting(tmp_path, monkeypatch):
    """`bench serve --vllm-python`: vLLM's OpenAI server on the checkpoint under the name our
    server reports, every core bound, the routing overrides passed; nothing preloaded that is
    not there."""
    from matrixinfer.bench.peers import vllm_server_command

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512,
                                                      "qk_rope_head_dim": 64}))
    venv = tmp_path / "venv_vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    cmd, env = vllm_server_command(Peers(vllm_python=str(venv / "bin" / "python")), str(tmp_path), "bfloat16", 2,
                                   8123, "m576", 64)
    assert cmd[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    args = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if flag.startswith("--")}
    assert args["--served-model-name"] == "m576" and args["--dtype"] == "bfloat16" and args["--port"] == "8123"
    assert args["--max-num-seqs"] == "64" and args["--model"] == str(tmp_path.resolve())
    assert json.loads(args["--hf-overrides"]) == {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "2"
    assert "VLLM_MLA_DISABLE" not in env  # 512 + 64: its MLA path serves
    preload = env["LD_PRELOAD"].split(":")
    assert str(venv / "lib" / "libiomp5.so") in preload and all(Path(p).exists() for p in preload)


def test_serve_report_compares_each_rate_with_the_peer():
    """The served comparison's table: ours, theirs and ours/theirs per rate and metric."""
    from matrixinfer.bench.serve_bench import _peer_table

    def row(rate, tok_s, ttft, tpot):
        return {"offered_rate": rate, "output_tok_s": tok_s, "ttft_p50_s": ttft, "tpot_p50_s": tpot}

    rep = {"results": [row(2.0, 200.0, 0.05, 0.010), row(float("inf"), 900.0, 1.0, None)]}
    peer = {"engine": "vLLM 0", "results": [row(2.0, 250.0, 0.04, 0.020), row(float("inf"), 600.0, 0.5, 0.02)]}
    lines = _peer_table(rep, peer).splitlines()
    assert lines[2].split(" | ")[1:] == ["200", "250", "0.80x", "50", "40", "1.25x", "10", "20", "0.50x |"]
    assert lines[3].startswith("| all at once | 900 | 600 | 1.50x | 1000 | 500 | 2.00x | - | 20 | - |")
