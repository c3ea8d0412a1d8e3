"""`matrixinfer bench engine`: our engine (compiled decode and prefill steps, the default) vs our own eager
mode vs transformers' batched `generate`, same checkpoint, dtype, threads and requests, in one
process run.

Reports output tokens/s of each and the ratios, the decode step time of each, and the
step-time floor: bytes a decode step must move (active weights + latent KV read) over the
memory bandwidth measured on this machine. torch.profiler tables say where a decode step's
time goes, eager and compiled, and the header names the CPU kernel path that ran.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from matrixinfer.bench.ops_bench import cpu_info
from matrixinfer.bench.report import markdown_table, save_json, write_section


@dataclass
class EngineBenchResult:
    model: str
    dtype: str
    threads: int
    requests: int
    input_len: int
    output_len: int
    matrixinfer_tokens_per_s: float
    eager_tokens_per_s: float
    transformers_tokens_per_s: float
    ratio: float  # compiled matrixinfer / transformers
    compiled_over_eager: float
    matrixinfer_decode_step_ms: float
    eager_decode_step_ms: float
    transformers_decode_step_ms: float
    compile_s: float  # the first engine's compile of the decode and prefill graphs (from the disk cache when warm)
    floor_decode_step_ms: float
    bytes_per_decode_step: int
    memory_bandwidth_gb_s: float
    flops_per_decode_step: int
    matmul_gflops: float
    repeats: int
    matrixinfer_seconds: float
    transformers_seconds: float
    profile_top_ops: list
    eager_profile_top_ops: list
    cpu: dict
    peers: list = field(default_factory=list)  # PeerResult dicts (llama.cpp, vLLM) when --peers ran them
    # every prompt through prefill (TTFT of the last request; transformers: one forward of the batch)
    matrixinfer_prefill_ms: float = float("nan")
    eager_prefill_ms: float = float("nan")
    transformers_prefill_ms: float = float("nan")


def measure_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s from a large tensor copy (read + write)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def measure_matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Dense matmul throughput in FLOP/s at this dtype and thread count."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _decode_weights(model):
    """(name, parameter, share of tokens that use it) for each weight a decode step reads:
    MTP is off and the embedding is a gather of a few rows."""
    cfg = model.config
    for name, p in model.named_parameters():
        if ".mtp." in name or name == "model.embed_tokens.weight":
            continue
        yield name, p, cfg.num_experts_per_tok / cfg.n_routed_experts if ".mlp.experts." in name else 1.0


def decode_step_flops(model, batch: int, context_len: int) -> int:
    """Matmul FLOPs of one decode step: every token through the dense weights, the shared and
    its top-k routed experts and the head, plus absorbed MLA over its latent context."""
    cfg = model.config
    per_token = sum(2 * p.numel() * share for name, p, share in _decode_weights(model)
                    if p.dim() >= 2 and ".mlp.gate." not in name)
    h, r, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    per_token += cfg.num_hidden_layers * h * 2 * (r + rope + r) * context_len  # scores + weighted latents
    per_token += cfg.num_hidden_layers * h * 2 * r * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # absorption
    return int(per_token * batch)


def decode_step_bytes(model, batch: int, context_len: int) -> int:
    """Weights a decode step reads (dense weights, shared experts, the routed experts a batch
    touches in expectation: an expert is read once if any token routes to it) plus the latent
    KV it reads."""
    cfg = model.config
    elt = model.lm_head.weight.element_size()
    total = sum(p.numel() * p.element_size() * (1 - (1 - share) ** batch)
                for _, p, share in _decode_weights(model))
    total += batch * cfg.hidden_size * elt
    kv = batch * context_len * cfg.kv_cache_dim * cfg.num_hidden_layers * elt
    return int(total + kv)


def _requests(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (input_len,), generator=g).tolist() for _ in range(n)]


class MatrixinferRun(NamedTuple):
    llm: object
    seconds: float
    decode_step_s: float  # median step while every request decodes
    top_ops: list
    tokens: list[list[int]]  # each request's output token ids
    tpot_s: tuple[float, ...] = ()  # per request, (last token - first token) / (tokens - 1), when asked
    prefill_s: float = float("nan")  # from the start until every prompt is through prefill (the last TTFT)


def run_matrixinfer(model_dir, dtype, prompts, output_len, profile: bool, enforce_eager: bool = False,
                    per_request_tpot: bool = False, warm_prompts: list[list[int]] | None = None,
                    compile_prefill: bool = True, max_num_seqs: int = 64,
                    max_num_batched_tokens: int = 2048, batch_invariant: bool = False, llm=None) -> MatrixinferRun:
    """Our engine on prompts after a warm-up generation of the same shape, as the peers get:
    warm_prompts, by default each prompt reversed (other ids, so no prefix-cache hit). The
    engine's limits (raised to fit the requests) size its compile warm-up, as `serve`'s do.
    llm: an engine to run on instead of a new one (the caller's limits)."""
    from matrixinfer import LLM, SamplingParams
    from matrixinfer.engine.sampling_params import RequestOutputKind

    if llm is None:
        llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=max(max_num_seqs, len(prompts)),
                  max_num_batched_tokens=max(max_num_batched_tokens, len(prompts[0]) * 4),
                  enforce_eager=enforce_eager, compile_prefill=compile_prefill, batch_invariant=batch_invariant)
    # one output per request when it finishes, as LLM.generate asks (and transformers returns)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    warm_prompts = [p[::-1] for p in prompts] if warm_prompts is None else warm_prompts
    llm.generate([{"prompt_token_ids": p} for p in warm_prompts], params, use_tqdm=False)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": p}, params)
    decode_times, top_ops, tokens = [], [], {}
    first, last = {}, {}  # per_request_tpot: when each request's first and last tokens came out
    start, prefill_s = time.perf_counter(), float("nan")
    desc = ("matrixinfer eager" if enforce_eager else "matrixinfer") + \
        (" batch-invariant" if llm.engine.config.batch_invariant else "")
    with tqdm(total=output_len, desc=desc, unit="step") as bar:  # about one step per output token
        while engine.has_unfinished_requests():
            running = len(engine.scheduler.running)
            all_decode = not engine.scheduler.waiting and all(s.num_uncomputed == 1 for s in engine.scheduler.running)
            t, steps = time.perf_counter(), engine.scheduler.stats.steps
            outs = engine.step()
            steps = engine.scheduler.stats.steps - steps  # decode steps the call ran (multi-step decode: up to k)
            if all_decode and running == len(prompts):
                decode_times.append((time.perf_counter() - t) / max(steps, 1))
            bar.update(steps)
            if math.isnan(prefill_s) and not engine.scheduler.waiting and \
                    all(s.num_uncomputed <= 1 for s in engine.scheduler.running):
                prefill_s = time.perf_counter() - start
            if per_request_tpot:  # as a streaming client times them, outside the timed step
                now = time.perf_counter()
                first.update((r.request_id, now) for r in engine.scheduler.running
                             if r.output_token_ids and r.request_id not in first)
                last.update((o.request_id, now) for o in outs)
            for o in outs:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    if profile:
        top_ops = profile_decode(llm, prompts, output_len)
    step = _median(decode_times) if decode_times else float("nan")
    tpot = [(last[r] - first[r]) / (output_len - 1) for r in last if r in first] if output_len > 1 else []
    return MatrixinferRun(llm, elapsed, step, top_ops, [tokens[f"bench-{i}"] for i in range(len(prompts))], tuple(tpot),
                          prefill_s)


UNTRACED = "(not an operator: compiled kernels, Python)"


def profile_decode(llm, prompts, output_len, steps: int = 10) -> list:
    """The top operators of `steps` engine steps by self CPU time under torch.profiler: % of
    the profiled wall time and ms per decode step (a multi-step call counts all its steps)."""
    from torch.profiler import ProfilerActivity, profile

    from matrixinfer import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{i}", {"prompt_token_ids": p}, params)
    while any(s.num_uncomputed > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    steps_before = engine.scheduler.stats.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()  # inside: the profiler's own start and stop took longer than the steps
        for _ in range(steps):
            engine.step()
        wall_us = (time.perf_counter() - t) * 1e6
    decode_steps = max(engine.scheduler.stats.steps - steps_before, 1)  # a multi-step call runs several
    for rid in list(engine.output_processor.requests):
        engine.abort_request(rid)
    rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    # a replayed graph's C++ kernels and the engine's Python run between the operators the
    # profiler records: without this row a compiled step's table showed only its allocations
    untraced = wall_us - sum(us for _, us in rows)
    if untraced > 0:
        rows.append((UNTRACED, untraced))
    top = sorted(rows, key=lambda r: r[1], reverse=True)[:12]
    return [[key, round(100 * us / wall_us, 1), round(us / decode_steps / 1000, 3)] for key, us in top]


def run_transformers(model_dir, dtype, prompts, output_len):
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # left-padded batch with an attention mask, as users call generate
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:1, :16], max_new_tokens=4, **{**kwargs, "attention_mask": mask[:1, :16]})
        t = time.perf_counter()
        model(ids, attention_mask=mask)
        prefill = time.perf_counter() - t
        print("transformers generate ...", flush=True)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        elapsed = time.perf_counter() - t
    assert out.shape[1] == width + output_len
    return elapsed, (elapsed - prefill) / max(1, output_len - 1), prefill


def _display_path(path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(p)


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def run(model_dir: str, requests: int, input_len: int, output_len: int, dtype: str, threads: int,
        profile: bool = True, repeats: int = 3, peers=None, peer_cache: Path | None = None,
        max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> EngineBenchResult:
    """Every side `repeats` times, interleaved so that drifts of a shared machine hit all;
    medians reported. `peers` (bench/peers.py): llama.cpp / vLLM run in their own processes, one
    at a time, on the same requests, after each round of ours."""
    torch.set_num_threads(threads)
    from matrixinfer.bench.peers import run_peer
    from matrixinfer.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    prompts = _requests(requests, input_len, cfg.vocab_size)
    warm = _requests(requests, input_len, cfg.vocab_size, seed=1)  # the peers' warm-up: same shape, other ids
    ours, eager, hf, peer_runs = [], [], [], {}
    for i in range(repeats):
        last = profile and i == repeats - 1
        limits = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        mi = run_matrixinfer(model_dir, dtype, prompts, output_len, last, warm_prompts=warm, **limits)
        if i == 0:  # the first engine: the cold (or disk-cached) compile of the decode and prefill graphs
            runner = mi.llm.engine.worker.runner
            compile_s = runner.compiled_decode.compile_s + runner.compiled_prefill.compile_s
        ours.append((mi.seconds, mi.decode_step_s, mi.prefill_s))
        top_ops, our_tokens = mi.top_ops, mi.tokens
        mi.llm.shutdown()
        ea = run_matrixinfer(model_dir, dtype, prompts, output_len, last, enforce_eager=True, warm_prompts=warm,
                             **limits)
        eager.append((ea.seconds, ea.decode_step_s, ea.prefill_s))
        eager_ops, llm = ea.top_ops, ea.llm
        hf.append(run_transformers(model_dir, dtype, prompts, output_len))
        for engine in peers.engines() if peers else []:
            print(f"{engine} ...", flush=True)
            peer_runs.setdefault(engine, []).append(
                run_peer(engine, peers, model_dir, dtype, threads, prompts, warm, output_len, cfg.vocab_size,
                         our_tokens, peer_cache or Path("bench-results") / "peers"))
    ours_s, ours_step = _median([o[0] for o in ours]), _median([o[1] for o in ours])
    eager_s, eager_step = _median([o[0] for o in eager]), _median([o[1] for o in eager])
    hf_s, hf_step = _median([h[0] for h in hf]), _median([h[1] for h in hf])
    n_out = requests * output_len
    bw = measure_bandwidth()
    peak = measure_matmul_flops(llm.engine.model.lm_head.weight.dtype)
    ctx = input_len + output_len // 2
    step_bytes = decode_step_bytes(llm.engine.model, requests, ctx)
    step_flops = decode_step_flops(llm.engine.model, requests, ctx)
    return EngineBenchResult(
        model=_display_path(model_dir), dtype=dtype, threads=threads, requests=requests, input_len=input_len,
        output_len=output_len, matrixinfer_tokens_per_s=n_out / ours_s, eager_tokens_per_s=n_out / eager_s,
        transformers_tokens_per_s=n_out / hf_s, ratio=hf_s / ours_s, compiled_over_eager=eager_s / ours_s,
        matrixinfer_decode_step_ms=ours_step * 1e3, eager_decode_step_ms=eager_step * 1e3,
        transformers_decode_step_ms=hf_step * 1e3, compile_s=compile_s,
        floor_decode_step_ms=max(step_bytes / bw, step_flops / peak) * 1e3, bytes_per_decode_step=step_bytes,
        memory_bandwidth_gb_s=bw / 1e9, flops_per_decode_step=step_flops, matmul_gflops=peak / 1e9, repeats=repeats, matrixinfer_seconds=ours_s, transformers_seconds=hf_s,
        profile_top_ops=top_ops, eager_profile_top_ops=eager_ops, cpu=cpu_info(),
        peers=[asdict(sorted(rs, key=lambda r: r.seconds)[len(rs) // 2]) for rs in peer_runs.values()],
        matrixinfer_prefill_ms=_median([o[2] for o in ours]) * 1e3, eager_prefill_ms=_median([o[2] for o in eager]) * 1e3,
        transformers_prefill_ms=_median([h[2] for h in hf]) * 1e3,
    )


def report(results: list[EngineBenchResult], name: str = "engine") -> None:
    rows = [[r.requests, r.input_len, r.output_len, r.dtype, r.threads, r.matrixinfer_tokens_per_s,
             r.eager_tokens_per_s, r.transformers_tokens_per_s, f"{r.compiled_over_eager:.2f}x", f"{r.ratio:.2f}x",
             r.matrixinfer_decode_step_ms, r.eager_decode_step_ms, r.transformers_decode_step_ms,
             r.floor_decode_step_ms, r.matrixinfer_prefill_ms, r.eager_prefill_ms, r.transformers_prefill_ms,
             r.compile_s] for r in results]
    table = markdown_table(["requests", "input", "output", "dtype", "threads", "matrixinfer tok/s", "eager tok/s",
                            "transformers tok/s", "compiled / eager", "matrixinfer / HF", "our step ms",
                            "eager step ms", "HF step ms", "floor step ms", "our prefill ms",
                            "eager prefill ms", "HF prefill ms", "compile s"], rows)
    last = max((r for r in results if r.profile_top_ops), key=lambda r: r.requests, default=results[-1])
    small = min((r for r in results if r.profile_top_ops), key=lambda r: r.requests, default=results[-1])
    cpu = last.cpu
    profiles = ""
    for r in [small] if small is last else [small, last]:
        if r.profile_top_ops:
            profiles += (f"\nWhere a decode step's time goes at {r.requests} request(s), eager and then compiled "
                         f"(torch.profiler, self CPU time; % of the profiled steps' wall time, ms per decode "
                         f"step, both under the profiler, which adds to each operator it records; "
                         f"`{UNTRACED}`: the wall time the profiler saw no operator in, the replayed "
                         f"graph's own kernels and the engine's Python):\n\n"
                         f"{markdown_table(['op (eager)', '% self CPU', 'ms / step'], r.eager_profile_top_ops)}\n\n"
                         f"{markdown_table(['op (compiled)', '% self CPU', 'ms / step'], r.profile_top_ops)}\n")
    title = "Engine" if name == "engine" else f"Engine ({name})"
    md = (f"## {title}: matrixinfer vs its eager mode vs transformers `generate`\n\n"
          f"`matrixinfer bench engine` on `{last.model}`; same checkpoint, dtype, threads and requests on every "
          f"side; greedy, `ignore_eos`, outputs of exactly `output` tokens; each side run {last.repeats} times, "
          f"interleaved, medians shown, each after a warm-up generation of the same shape (other ids). matrixinfer "
          f"runs its default, the compiled decode and prefill steps (`worker/compiled_decode.py`, "
          f"`worker/compiled_prefill.py`); eager is the same engine with `--enforce-eager`. CPU: {cpu['cpu']}, "
          f"torch kernel path `{cpu['torch_cpu_capability']}`, AMX: {', '.join(cpu['amx']) or 'none'}, "
          f"AVX512-VNNI: {'yes' if cpu['avx512_vnni'] else 'no'}; bfloat16 GEMMs "
          f"{cpu.get('bf16_gemms', '(unrecorded)')}; the few-rows operator built for "
          f"{', '.join(cpu.get('small_mm', [])) or 'no dtype'} (in compiled steps: "
          f"{', '.join(cpu.get('small_mm_compiled', [])) or 'unrecorded'}). The floor of a decode step is the larger of the "
          f"bytes it must read ({last.bytes_per_decode_step / 1e6:.1f} MB at {last.requests} requests: active weights "
          f"+ latent KV) over the measured copy bandwidth ({last.memory_bandwidth_gb_s:.1f} GB/s) and the matmul "
          f"FLOPs it must do ({last.flops_per_decode_step / 1e9:.2f} GFLOP) over the measured dense matmul rate "
          f"({last.matmul_gflops:.0f} GFLOP/s). `prefill ms`: from the start until every prompt is through "
          f"prefill, the last request's time to first token (transformers: one forward of the padded batch). "
          f"`compile s`: the decode and prefill steps' graphs compiled when the engine "
          f"starts (from inductor's disk cache when an earlier run filled it; later engines of the process trace their "
          f"own graphs again: each model instance keeps its own).\n\n{table}\n\n![engine](engine.png)\n{profiles}")
    if any(r.peers for r in results):
        md += "\n" + peers_section(results, name)
    write_section(name, md.replace("](engine.png)", f"]({name}.png)"))
    save_json(name, {"results": [asdict(r) for r in results]})
    plot(results, name)
    if any(r.peers for r in results):
        plot_peers(results, name)


def _engines(r: EngineBenchResult) -> dict[str, float]:
    """Output tokens/s of every engine of one result, ours first."""
    out = {"matrixinfer": r.matrixinfer_tokens_per_s, "matrixinfer eager": r.eager_tokens_per_s,
           "transformers": r.transformers_tokens_per_s}
    out.update({p["engine"]: p["tokens_per_s"] for p in r.peers})
    return out


def peers_section(results: list[EngineBenchResult], name: str = "engine") -> str:
    rows = []
    for r in results:
        for p in r.peers:
            rows.append([r.requests, r.input_len, r.output_len, r.dtype, p["engine"], p["tokens_per_s"],
                         r.matrixinfer_tokens_per_s, f"{r.matrixinfer_tokens_per_s / p['tokens_per_s']:.2f}x",
                         f"{100 * p['greedy_agreement']:.1f} %", f"{100 * p['requests_identical']:.0f} %"])
    table = markdown_table(["requests", "input", "output", "dtype", "peer", "peer tok/s", "matrixinfer tok/s",
                            "matrixinfer / peer", "tokens equal to ours", "requests equal to ours"], rows)
    return ("### The CPU peers (`--peers`)\n\nThe same requests (token ids), dtype and threads, each peer in a "
            "process of its own after our engine's round (one engine at a time), a warm-up call of the same "
            "shape with other ids first; medians of the rounds. llama.cpp runs through llama-cpp-python's "
            "batched low-level API on a GGUF made by llama.cpp's own converter; vLLM through its offline "
            "`LLM.generate`. Greedy agreement is position by position against matrixinfer's tokens (float "
            "rounding differs between engines, so a tie late in a sequence can diverge).\n\n"
            f"{table}\n\n![engine peers]({name}-peers.png)\n")


def plot_peers(results: list[EngineBenchResult], name: str = "engine") -> None:
    """Output tokens/s vs concurrent requests, a line per engine, a panel per (input, output) shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matrixinfer.bench.report import bench_dir

    shapes = sorted({(r.input_len, r.output_len) for r in results})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (i, o) in zip(axes[0], shapes):
        rs = sorted((r for r in results if (r.input_len, r.output_len) == (i, o)), key=lambda r: r.requests)
        for engine in _engines(rs[0]):
            pts = [(r.requests, _engines(r)[engine]) for r in rs if engine in _engines(r)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{rs[0].dtype}, {i} in + {o} out, {rs[0].threads} threads")
        ax.legend()
    fig.tight_layout()
    fig.savefig(bench_dir() / f"{name}-peers.png", dpi=110)


def plot(results: list[EngineBenchResult], name: str = "engine") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matrixinfer.bench.report import bench_dir

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r.requests} req\n{r.input_len}+{r.output_len}" for r in results]
    x = range(len(results))
    a.bar([i - 0.27 for i in x], [r.matrixinfer_tokens_per_s for r in results], 0.27, label="matrixinfer")
    a.bar(list(x), [r.eager_tokens_per_s for r in results], 0.27, label="matrixinfer eager")
    a.bar([i + 0.27 for i in x], [r.transformers_tokens_per_s for r in results], 0.27, label="transformers")
    a.set_xticks(list(x), labels)
    a.set_ylabel("output tokens/s")
    a.legend()
    for j, (vals, label) in enumerate([([r.matrixinfer_decode_step_ms for r in results], "matrixinfer"),
                                        ([r.eager_decode_step_ms for r in results], "matrixinfer eager"),
                                        ([r.transformers_decode_step_ms for r in results], "transformers"),
                                        ([r.floor_decode_step_ms for r in results], "floor (bytes or FLOPs)")]):
        b.bar([i + (j - 1.5) * 0.2 for i in x], vals, 0.2, label=label)
    b.set_xticks(list(x), labels)
    b.set_ylabel("decode step (ms)")
    b.legend()
    fig.suptitle(f"{results[0].dtype}, {results[0].threads} threads (requests, input+output tokens)")
    fig.tight_layout()
    fig.savefig(bench_dir() / f"{name}.png", dpi=110)


def main(args) -> int:
    if len(args.input_len) != len(args.output_len):
        raise ValueError("--input-len and --output-len take the same number of values (they pair up)")
    from matrixinfer.bench.peers import Peers

    explicit = dict(llama_python=args.llama_python, vllm_python=args.vllm_python, llama_cpp_src=args.llama_cpp_src,
                    gguf=args.peer_gguf)
    peers = None
    if args.peers:
        peers = Peers.from_dir(args.peers, **explicit)
    elif args.llama_python or args.vllm_python:
        peers = Peers(**explicit)
    results = []
    for input_len, output_len in zip(args.input_len, args.output_len):
        for n in args.requests:
            results.append(run(args.model, n, input_len, output_len, args.dtype, args.threads,
                               profile=not args.no_profile, repeats=args.repeats, peers=peers,
                               peer_cache=Path(args.out) / "peers", max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens))
            r = results[-1]
            print(f"{n} requests, {input_len}+{output_len} tokens: matrixinfer {r.matrixinfer_tokens_per_s:.1f} "
                  f"tok/s (eager {r.eager_tokens_per_s:.1f}), transformers {r.transformers_tokens_per_s:.1f} tok/s, "
                  f"compiled/eager {r.compiled_over_eager:.2f}x, vs HF {r.ratio:.2f}x"
                  + "".join(f", {p['engine']} {p['tokens_per_s']:.1f} tok/s ({100 * p['greedy_agreement']:.0f} % "
                            f"tokens equal)" for p in r.peers), flush=True)
    if not args.no_write:
        report(results, args.name)
    if args.json:  # the headline: most requests at the first (default) shape
        first = [r for r in results if r.input_len == args.input_len[0] and r.output_len == args.output_len[0]]
        print(json.dumps(asdict(max(first, key=lambda r: r.requests))))
    return 0
