"""`matrixinfer bench ops`: operator costs of this machine, written as a simulator hardware YAML.

Measures on the local device (CPU; CUDA when torch.cuda.is_available()):
  GEMM throughput by shape and dtype (float32, bfloat16; int8 through torch._int_mm where it
  runs), absorbed-MLA decode attention by batch and context (the tensor math of
  MLAttention._attend_absorbed at a model's shapes), memory bandwidth, all-gather and
  all-to-all latency by message size across 2 local processes (gloo), and the engine's
  host overhead per step (the public LLM API at batch 1, 4, 8 minus the modelled operators).
Every fitted line is `time = fixed + work / rate`: the rate gives the throughput, the fixed
part the launch cost. The YAML's `sources:` say "measured on <cpu>" for each number.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

GEMM_SHAPES = [(m, k, n) for m in (1, 16, 64, 256, 1024) for k, n in ((256, 256), (256, 1024), (1024, 1024))]
ATTN_BATCHES = (1, 4, 16)
ATTN_CONTEXTS = (64, 256, 1024)
COLL_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21)  # bytes per rank
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# plane values written when the collectives are skipped (--no-collectives); sourced as assumptions
UNMEASURED_LATENCY_S, UNMEASURED_B_S = 50e-6, 1e9
HOST_FIT_BATCHES = (1, 4, 8)  # engine decode steps (16-token prompts) the host costs are fitted to
PREFILL_FIT = (1, 256)  # (prompts, tokens): the engine prefill the prefill factor is fitted to
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe"


# ---------------------------------------------------------------- machine and timing

def cpu_info() -> dict:
    """CPU model, torch's CPU kernel path, and the matrix-extension flags the kernels can use."""
    from matrixinfer.kernels import bfloat16_gemm_policy, cpu_flags, load_cpu_ops, small_mm_serves
    from matrixinfer.model.layers.quantization import SMALL_MM_COMPILED

    name, flags = platform.processor() or "unknown CPU", cpu_flags()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "amx": sorted(f for f in flags if f.startswith("amx")), "avx512_vnni": "avx512_vnni" in flags,
            "bf16_gemms": bfloat16_gemm_policy(),
            "small_mm": [str(d)[6:] for d in (torch.float32, torch.bfloat16)
                         if load_cpu_ops() and small_mm_serves(d, torch.device("cpu"))],
            "small_mm_compiled": sorted(str(d)[6:] for d in SMALL_MM_COMPILED),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def best_time(fn, device: str, repeats: int = 5, min_s: float = 0.02) -> float:
    """Fastest of `repeats` timings, each of enough calls to last `min_s` (one warm-up call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    calls, t0 = 1, time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(min_s / one))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x, intercept clipped at 0 (refit through 0)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


# ---------------------------------------------------------------- operators

def gemm_rows(device: str, bar) -> list[dict]:
    rows = []
    for dtype in ("fp32", "bf16", "int8"):
        for m, k, n in GEMM_SHAPES:
            bar.update()
            if dtype == "int8":
                if m <= 16 or not hasattr(torch, "_int_mm"):
                    continue  # torch._int_mm needs M > 16
                a = torch.randint(-8, 8, (m, k), dtype=torch.int8, device=device)
                b = torch.randint(-8, 8, (k, n), dtype=torch.int8, device=device)
                fn = lambda a=a, b=b: torch._int_mm(a, b)  # noqa: E731
                try:
                    fn()
                except RuntimeError:
                    continue
            else:
                a = torch.randn(m, k, dtype=TORCH_DTYPES[dtype], device=device)
                b = torch.randn(k, n, dtype=TORCH_DTYPES[dtype], device=device)
                fn = lambda a=a, b=b: a @ b  # noqa: E731
            t = best_time(fn, device)
            rows.append({"dtype": dtype, "m": m, "k": k, "n": n, "s": t, "tflops": 2 * m * k * n / t / 1e12})
    return rows


def absorbed_attention(q_nope, q_pe, latents, w_uk, w_uv, lens, rank: int, scale: float):
    """The math of MLAttention._attend_absorbed, same shapes: q_* [S, H, *], latents [S, T, rank + rope]."""
    q_lat = torch.einsum("shd,hdr->shr", q_nope, w_uk)
    q = torch.cat([q_lat, q_pe], dim=-1)
    scores = torch.bmm(q, latents.transpose(1, 2)).float() * scale
    valid = torch.arange(latents.shape[1], device=q.device)[None, :] < lens[:, None]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.einsum("shr,hvr->shv", torch.bmm(probs, latents[..., :rank]), w_uv)


def attention_rows(cfg: dict, device: str, dtype: str, bar) -> list[dict]:
    h, nope, rope, v, rank = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim", "kv_lora_rank"))
    dt = TORCH_DTYPES[dtype]
    w_uk, w_uv = torch.randn(h, nope, rank, dtype=dt, device=device), torch.randn(h, v, rank, dtype=dt, device=device)
    rows = []
    for s in ATTN_BATCHES:
        for t in ATTN_CONTEXTS:
            bar.update()
            q_nope, q_pe = torch.randn(s, h, nope, dtype=dt, device=device), torch.randn(s, h, rope, dtype=dt, device=device)
            lat = torch.randn(s, t, rank + rope, dtype=dt, device=device)
            lens = torch.full((s,), t, device=device)
            sec = best_time(lambda: absorbed_attention(q_nope, q_pe, lat, w_uk, w_uv, lens, rank, 0.1), device)
            # the simulator's count for absorbed MLA: 2 H (rank + rope + rank) per (query, position)
            flops = 2 * h * (2 * rank + rope) * s * t
            rows.append({"batch": s, "context": t, "s": sec, "flops": flops, "tflops": flops / sec / 1e12})
    return rows


def op_launch_s(device: str) -> float:
    """Cost of launching one tiny operator (a 1-element add): the per-op dispatch floor."""
    a, b = torch.ones(1, device=device), torch.ones(1, device=device)
    return best_time(lambda: a + b, device, repeats=5, min_s=0.02)


def bandwidth_gb_s(device: str, n_bytes: int = 128 * 2**20) -> float:
    """Copy of a tensor much larger than the caches: read + write bytes over time."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / best_time(lambda: dst.copy_(src), device, repeats=5, min_s=0.05) / 1e9


# ---------------------------------------------------------------- collectives (2 processes)

def _lockstep_time(fn, dist, repeats: int = 5, calls: int = 10) -> float:
    """Fastest of `repeats` timings of `calls` collectives; a fixed count, so that every rank
    issues the same sequence (an adaptive count per rank would deadlock)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _collective_worker(rank: int, world: int, port: int, sizes: tuple, out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        rows = []
        for size in sizes:
            x = torch.ones(size // 4 * world, dtype=torch.float32)
            gathered = [torch.empty(size // 4, dtype=torch.float32) for _ in range(world)]
            y = torch.empty_like(x)
            ops = {"all_gather": lambda: dist.all_gather(gathered, x[: size // 4]),
                   "all_to_all": lambda: dist.all_to_all_single(y, x)}
            for name, fn in ops.items():
                try:
                    t = _lockstep_time(fn, dist)
                except RuntimeError as e:  # a backend without this collective
                    rows.append({"op": name, "bytes": size, "error": str(e)[:200]})
                    continue
                rows.append({"op": name, "bytes": size, "s": t})
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def collective_rows(sizes=COLL_SIZES, world: int = 2, timeout_s: float = 120.0) -> list[dict]:
    """Spawn `world` processes, time gloo all-gather / all-to-all of `sizes` bytes per rank;
    every process is joined or killed before returning, whatever happens."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        procs = [ctx.Process(target=_collective_worker, args=(r, world, port, tuple(sizes), out)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
            if any(p.is_alive() for p in procs) or any(p.exitcode for p in procs):
                raise RuntimeError(f"collective workers failed or timed out after {timeout_s:.0f} s "
                                   f"(exit codes {[p.exitcode for p in procs]})")
            return json.loads(Path(out).read_text())
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)


# ---------------------------------------------------------------- engine host overhead

def engine_decode_step_s(llm, batch: int, prompt_len: int, steps: int = 16) -> float:
    """Decode step time of the real engine: (generate of 1 + steps tokens - generate of 1) / steps."""
    from matrixinfer import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 3 for j in range(prompt_len)]} for i in range(batch)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return max(0.0, min(run(1 + steps) for _ in range(3)) - min(run(1) for _ in range(3))) / steps


def engine_prefill_s(llm, prompts: int, prompt_len: int) -> float:
    """Time of one generate that only prefills (max_tokens=1), best of 3."""
    from matrixinfer import SamplingParams

    batch = [{"prompt_token_ids": [(11 * i + j) % 1000 + 3 for j in range(prompt_len)]} for i in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------- the hardware YAML

@dataclass
class OpsResult:
    machine: dict
    gemm: list
    attention: list
    bandwidth_gb_s: float
    collectives: list
    engine_steps_s: dict
    fitted: dict


def _fit_rate(rows: list[dict], work_key: str) -> tuple[float, float]:
    """(fixed seconds, work per second) of time = fixed + work / rate."""
    a, b = fit_line([r[work_key] for r in rows], [r["s"] for r in rows])
    return a, (1.0 / b if b > 0 else float("inf"))


def hardware_dict(res: OpsResult, name: str) -> dict:
    """The measurements in the simulator's hardware format (one device, one node)."""
    f, cpu = res.fitted, res.machine["cpu"] if not res.machine["cuda"] else res.machine["cuda"]
    m = f"measured on {cpu}"
    tflops = {d: round(v, 6) for d, v in f["peak_tflops"].items()}
    raw = {
        "name": name, "devices": 1, "devices_per_node": 1,
        "device": {"name": cpu, "per_package": 1, "tflops": tflops, "hbm_gb": f["memory_gb"],
                   "hbm_tb_s": round(res.bandwidth_gb_s / 1e3, 6)},
        "efficiency": {"mla_compute": round(f["mla_compute"], 4), "mla_memory": 1.0,
                       "gemm": {d: round(v, 4) for d, v in f["gemm_eff"].items()}, "link": 1.0, "overlap": 1.0},
        "ep_decode_plane": "scale_up",
        "planes": {p: {"name": n, "gb_s": round(f["coll_gb_s"], 4), "latency_us": round(f["coll_latency_us"], 3),
                       "per_peer_us": 0.0, "domain": 0} for p, n in (("scale_up", "local gloo"), ("scale_out", "local gloo"))},
        "host": {k: round(f[k], 3) for k in ("step_overhead_us", "per_seq_us", "op_launch_us", "prefill_factor")},
    }
    raw["planes"]["vpc_node_gb_s"] = round(f["coll_gb_s"], 4)
    src = {"devices": "hardware fact: one local device", "devices_per_node": "hardware fact: one local device",
           "device.per_package": "hardware fact: one local device",
           "device.hbm_gb": f"{m}: total memory (sysconf / CUDA)",
           "device.hbm_tb_s": f"{m}: copy of a 128 MB tensor (read + write)",
           "efficiency.mla_compute": f"{m}: absorbed-MLA rate from the attention sweep / fp32 peak",
           "efficiency.mla_memory": f"{m}: 1, the bandwidth above is what is achieved",
           "efficiency.link": f"{m}: 1, the plane bandwidth is the achieved gloo bandwidth",
           "efficiency.overlap": "assumption: unused, the local engine runs one microbatch",
           "host.step_overhead_us": f"{m}: engine decode steps at batch 1, 4, 8 (16-token prompts) minus modelled operators, line fit",
           "host.per_seq_us": f"{m}: engine decode steps at batch 1, 4, 8 (16-token prompts) minus modelled operators, line fit",
           "host.op_launch_us": f"{m}: a 1-element add, timed in a loop",
           "host.prefill_factor": f"fitted to one engine prefill ({PREFILL_FIT[0]} x {PREFILL_FIT[1]} tokens) {m}: "
                                  "(measured - host costs) / modelled operators"}
    for d in tflops:
        src[f"device.tflops.{d}"] = f"{m}: fastest GEMM of the {d} sweep"
        src[f"efficiency.gemm.{d}"] = f"{m}: slope of the {d} GEMM sweep / its peak"
    coll = f"{m}: slope / intercept of gloo all-to-all time against bytes, 2 processes" if res.collectives \
        else "assumption: not measured (--no-collectives)"
    for p in ("scale_up", "scale_out"):
        src[f"planes.{p}.gb_s"] = coll
        src[f"planes.{p}.latency_us"] = coll
        src[f"planes.{p}.per_peer_us"] = "assumption: 0, one peer only"
        src[f"planes.{p}.domain"] = "assumption: unbounded"
    src["planes.vpc_node_gb_s"] = coll
    if not res.engine_steps_s:
        src["host.step_overhead_us"] = src["host.per_seq_us"] = "assumption: 0, not measured (--no-engine)"
        src["host.prefill_factor"] = "assumption: 1, not measured (--no-engine)"
    raw["sources"] = src
    return raw


def fit(res_partial: dict, model_dir: Path, precision: str) -> dict:
    """Rates, efficiencies and host costs from the raw rows (see hardware_dict for where each goes)."""
    from matrixinfer.sim import local
    from matrixinfer.sim.hardware import hardware_from_dict
    from matrixinfer.sim.modelspec import load_model

    gemm, attn, coll = res_partial["gemm"], res_partial["attention"], res_partial["collectives"]
    peak, eff = {}, {}
    for d in sorted({r["dtype"] for r in gemm}):
        rows = [dict(r, flops=2 * r["m"] * r["k"] * r["n"]) for r in gemm if r["dtype"] == d]
        _, rate = _fit_rate(rows, "flops")
        peak[d] = max(r["tflops"] for r in rows)
        eff[d] = min(1.0, rate / 1e12 / peak[d])
    fixed_a, rate_a = _fit_rate(attn, "flops")
    a2a = [r for r in coll if r.get("op") == "all_to_all" and "s" in r] or [r for r in coll if "s" in r]
    lat, bw = _fit_rate(a2a, "bytes") if a2a else (UNMEASURED_LATENCY_S, UNMEASURED_B_S)
    fitted = {"peak_tflops": peak, "gemm_eff": eff, "mla_compute": min(1.0, rate_a / 1e12 / peak["fp32"]),
              "op_launch_us": 1e6 * res_partial["op_launch_s"], "coll_latency_us": max(1e-3, 1e6 * lat), "coll_gb_s": bw / 1e9,
              "memory_gb": round((torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
                                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 1e9, 1),
              "step_overhead_us": 0.0, "per_seq_us": 0.0, "prefill_factor": 1.0}
    steps = res_partial["engine_steps_s"]
    if steps:
        # host cost = measured engine step - modelled operators, linear in the batch
        hw = hardware_from_dict(hardware_dict(OpsResult(res_partial["machine"], gemm, attn,
                                                        res_partial["bandwidth_gb_s"], coll, steps, fitted), "tmp"))
        model = load_model(str(model_dir))
        bs = sorted(int(b) for b in steps)
        resid = [steps[str(b)] - local.decode_step(hw, model, b, 16, precision).time_s for b in bs]
        fixed, per_seq = fit_line(bs, resid) if len(bs) > 1 else (resid[0], 0.0)
        fitted["per_seq_us"] = max(0.0, 1e6 * per_seq)
        fitted["step_overhead_us"] = max(0.0, 1e6 * fixed)
        prefill = res_partial.get("engine_prefill_s")
        if prefill:
            hw = hardware_from_dict(hardware_dict(OpsResult(res_partial["machine"], gemm, attn,
                                                            res_partial["bandwidth_gb_s"], coll, steps, fitted), "tmp"))
            modelled = local.prefill_step(hw, model, *PREFILL_FIT, precision)
            fitted["prefill_factor"] = max(1.0, (prefill - modelled.host_s) / modelled.ops_s)
    return fitted


def run_ops(model_dir: Path = DEFAULT_MODEL, dtype: str = "float32", engine: bool = True,
            collectives: bool = True, quiet: bool = False) -> OpsResult:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    machine = cpu_info() | {"device": device}
    n_steps = 3 * len(GEMM_SHAPES) + len(ATTN_BATCHES) * len(ATTN_CONTEXTS) + 2 + len(HOST_FIT_BATCHES)
    with tqdm(total=n_steps, desc="bench ops", disable=quiet) as bar:
        gemm = gemm_rows(device, bar)
        attn = attention_rows(cfg, device, precision, bar)
        bw = bandwidth_gb_s(device)
        launch = op_launch_s(device)
        bar.update()
        coll = collective_rows() if collectives else []
        bar.update()
        steps = {}
        if engine:
            from matrixinfer import LLM

            llm = LLM(model=str(model_dir), dtype=dtype, max_num_seqs=16, max_num_batched_tokens=4096,
                      enable_prefix_caching=False)
            for b in HOST_FIT_BATCHES:
                steps[str(b)] = engine_decode_step_s(llm, b, 16)
                bar.update()
            prefill_s = engine_prefill_s(llm, *PREFILL_FIT)
    partial = {"machine": machine, "gemm": gemm, "attention": attn, "bandwidth_gb_s": bw, "op_launch_s": launch,
               "collectives": coll, "engine_steps_s": steps, "engine_prefill_s": prefill_s if engine else None}
    return OpsResult(machine, gemm, attn, bw, coll, steps, fit(partial, Path(model_dir), precision))


def cmd_bench_ops(args) -> int:
    from matrixinfer.bench.report import bench_dir

    args.yaml = args.yaml or str(bench_dir() / "ops.yaml")
    from matrixinfer.bench.report import markdown_table, save_json, write_section

    torch.set_num_threads(args.threads)
    res = run_ops(Path(args.model), args.dtype, engine=not args.no_engine, collectives=not args.no_collectives,
                  quiet=args.json)
    hw = hardware_dict(res, f"local ({res.machine['cpu']}, {args.threads} threads)")
    Path(args.yaml).parent.mkdir(parents=True, exist_ok=True)
    Path(args.yaml).write_text(f"# written by `matrixinfer bench ops` ({time.strftime('%Y-%m-%d')}); "
                              f"{json.dumps({k: res.machine[k] for k in ('torch_cpu_capability', 'amx', 'avx512_vnni', 'threads')})}\n"
                              + yaml.safe_dump(hw, sort_keys=False))
    if args.json:
        print(json.dumps(asdict(res) | {"hardware_yaml": args.yaml}))
        return 0
    save_json("ops", asdict(res))
    f = res.fitted
    md = (f"Machine: {res.machine['cpu']}, torch CPU kernel path `{res.machine['torch_cpu_capability']}`, "
          f"AMX {res.machine['amx'] or 'no'}, AVX512-VNNI {'yes' if res.machine['avx512_vnni'] else 'no'}, "
          f"{args.threads} thread(s). Written to `{args.yaml}` (the simulator's hardware format).\n\n"
          + markdown_table(["dtype", "peak TFLOPS (best shape)", "sweep rate / peak"],
                           [[d, f["peak_tflops"][d], f["gemm_eff"][d]] for d in f["peak_tflops"]])
          + "\n\n" + markdown_table(["quantity", "value"], [
              ["memory bandwidth GB/s", res.bandwidth_gb_s], ["absorbed MLA rate / fp32 peak", f["mla_compute"]],
              ["op launch us", f["op_launch_us"]], ["gloo all-to-all latency us", f["coll_latency_us"]],
              ["gloo all-to-all GB/s", f["coll_gb_s"]], ["engine step overhead us", f["step_overhead_us"]],
              ["engine per-sequence us", f["per_seq_us"]],
              ["engine prefill factor (eager prefill / rooflines)", f["prefill_factor"]]]))
    write_section("ops", "## Operator costs of this machine (`matrixinfer bench ops`)\n\n" + md)
    print(md)
    return 0
