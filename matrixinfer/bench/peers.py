"""The CPU peers for `matrixinfer bench engine --peers`: llama.cpp (through llama-cpp-python) and
vLLM's CPU build, each run under its own interpreter, one process at a time, on the same
checkpoint, dtype, threads and token-id requests as our engine.

Nothing here is imported by the engine or the tests' fixtures: a user points the bench at the
peers (a folder laid out as ../shared/peers describes, or the interpreters one by one) and the
bench converts the checkpoint as each needs (GGUF for llama.cpp, with llama.cpp's converter).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

RUNNERS = Path(__file__).parent / "peer_runners"


@dataclass
class Peers:
    llama_python: str | None = None  # an interpreter with llama-cpp-python installed
    llama_cpp_src: str | None = None  # a llama.cpp source tree: its convert_hf_to_gguf.py makes the GGUF
    gguf: str | None = None  # or a GGUF file of the checkpoint in the bench's dtype, made beforehand
    vllm_python: str | None = None  # an interpreter with vLLM (CPU build) installed
    timeout_s: float = 1800.0

    @classmethod
    def from_dir(cls, peers_dir: str, **explicit) -> Peers:
        """A folder as in shared/peers: venv_llama/, venv_vllm/ and a llama.cpp source
        (llama.cpp/, or the llama-cpp-python sdist unpacked: llama_cpp_python-*/vendor/llama.cpp).
        Explicit paths win over what the folder holds."""
        root = Path(peers_dir)
        found: dict = {}
        for key, venv in (("llama_python", "venv_llama"), ("vllm_python", "venv_vllm")):
            if (root / venv / "bin" / "python").exists():
                found[key] = str(root / venv / "bin" / "python")
        sources = [root / "llama.cpp", *sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))]
        src = next((s for s in sources if (s / "convert_hf_to_gguf.py").exists()), None)
        if src is not None:
            found["llama_cpp_src"] = str(src)
        found.update({k: v for k, v in explicit.items() if v is not None})
        if not (found.get("llama_python") or found.get("vllm_python")):
            raise ValueError(f"{peers_dir} holds neither venv_llama/bin/python nor venv_vllm/bin/python")
        return cls(**found)

    def engines(self) -> list[str]:
        return [name for name, python in (("llama.cpp", self.llama_python), ("vLLM", self.vllm_python)) if python]


@dataclass
class PeerResult:
    engine: str
    tokens_per_s: float
    seconds: float
    greedy_agreement: float  # fraction of output tokens equal to ours, position by position
    requests_identical: float  # fraction of requests whose whole output equals ours


def gguf_for(peers: Peers, model_dir: str, dtype: str, cache_dir: Path) -> str:
    """The GGUF llama.cpp loads: the one given, or the checkpoint converted once (per dtype) into cache_dir."""
    if peers.gguf:
        return peers.gguf
    if not peers.llama_cpp_src:
        raise ValueError("llama.cpp needs a GGUF: pass --peer-gguf FILE, or a llama.cpp source tree "
                         "(--llama-cpp-src, or one in the --peers folder) to convert the checkpoint with")
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    # keyed by the checkpoint's path and its files' sizes and times, not its folder name alone:
    # another checkpoint of the same name, or this one rewritten, gets a conversion of its own
    src = Path(model_dir).resolve()
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(src.iterdir()) if f.is_file()]
    key = hashlib.sha1(repr((str(src), stamp)).encode()).hexdigest()[:12]
    out = cache_dir / f"{src.name}-{key}-{outtype}.gguf"
    if not out.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        _run([sys.executable, str(RUNNERS / "convert_gguf.py"), peers.llama_cpp_src, model_dir, outtype, str(tmp)],
             None, peers.timeout_s, "the GGUF conversion")
        tmp.rename(out)
    return str(out)


def vllm_overrides(model_dir: str) -> tuple[dict, dict]:
    """(hf_overrides, environment) vLLM needs for a DeepSeek checkpoint: transformers 5 drops
    V3's scoring_func / topk_method from config.json, and vLLM's CPU MLA kernel takes only a
    576-wide latent (kv_lora_rank + rope = 512 + 64); other widths run its non-MLA path."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    overrides = {}
    if cfg.get("model_type") == "deepseek_v3":
        overrides = {"scoring_func": cfg.get("scoring_func", "sigmoid"), "topk_method": cfg.get("topk_method", "noaux_tc")}
    width = cfg.get("kv_lora_rank", 0) + cfg.get("qk_rope_head_dim", 0)
    return overrides, {} if width == 576 else {"VLLM_MLA_DISABLE": "1"}


def vllm_environment(peers: Peers, model_dir: str, threads: int) -> tuple[dict, dict]:
    """(hf_overrides, environment) of a vLLM process in its best CPU setting on a small
    machine: every core computes (its default reserves one), and the allocator and OpenMP
    runtime its CPU guide preloads (tcmalloc, the venv's Intel OpenMP) where they are present."""
    overrides, extra = vllm_overrides(model_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="2", **extra)
    venv = Path(peers.vllm_python).parent.parent
    preload = [str(p) for p in (*sorted(Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4")), venv / "lib" / "libiomp5.so")
               if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else preload)
    return overrides, env


def vllm_server_command(peers: Peers, model_dir: str, dtype: str, threads: int, port: int, served_name: str,
                        max_num_seqs: int) -> tuple[list[str], dict]:
    """(argv, environment) of vLLM's OpenAI server on the checkpoint, under the name our server
    gives it, so one load generator drives both with the same requests."""
    overrides, env = vllm_environment(peers, model_dir, threads)
    cmd = [peers.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model_dir).resolve()),
           "--served-model-name", served_name, "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1",
           "--max-num-seqs", str(max_num_seqs), "--disable-log-stats"]
    if overrides:
        cmd += ["--hf-overrides", json.dumps(overrides)]
    return cmd, env


def run_peer(engine: str, peers: Peers, model_dir: str, dtype: str, threads: int, prompts: list[list[int]],
             warm_prompts: list[list[int]], output_len: int, vocab: int, ours: list[list[int]],
             cache_dir: Path) -> PeerResult:
    """One peer, one process: a warm-up call, then the timed call on `prompts`."""
    job = dict(prompts=prompts, warm_prompts=warm_prompts, output_len=output_len, threads=threads, vocab=vocab)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if engine == "llama.cpp":
        job["gguf"] = gguf_for(peers, model_dir, dtype, cache_dir)
        cmd = [peers.llama_python, str(RUNNERS / "run_llama_cpp.py")]
    elif engine == "vLLM":
        overrides, env = vllm_environment(peers, model_dir, threads)
        job.update(model=str(Path(model_dir).resolve()), dtype=dtype, hf_overrides=overrides)
        cmd = [peers.vllm_python, str(RUNNERS / "run_vllm.py")]
    else:
        raise ValueError(f"unknown peer {engine!r}")
    out = _run(cmd, json.dumps(job), peers.timeout_s, engine, env)
    # the runner's answer is its one line starting {"engine" (vLLM also logs to stdout on exit)
    answer = [line for line in out.splitlines() if line.startswith('{"engine"')]
    if not answer:
        raise RuntimeError(f"{engine} gave no result: {out.strip()[-2000:]}")
    res = json.loads(answer[-1])
    tokens = res["tokens"]
    same = sum(a == b for t, o in zip(tokens, ours) for a, b in zip(t, o))
    return PeerResult(engine=res["engine"], tokens_per_s=len(prompts) * output_len / res["seconds"],
                      seconds=res["seconds"], greedy_agreement=same / max(1, len(prompts) * output_len),
                      requests_identical=sum(t == o for t, o in zip(tokens, ours)) / max(1, len(prompts)))


def _run(cmd: list[str], stdin: str | None, timeout: float, what: str, env: dict | None = None) -> str:
    try:
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{what} did not finish in {timeout:.0f} s") from e
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout
