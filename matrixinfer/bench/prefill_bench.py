"""`matrixinfer bench prefill`: one prefill instance of P ranks, three ways to parallelise
attention, the same heavy-tailed batches of prompts (many short, a few long).

- dp: attention data parallel, routed experts partitioned (issue 11's layout): each rank
  prefills whole prompts (placed by the engine's rule: the rank with the fewest requests),
  the MoE exchanges tokens; the step ends when the rank with the most work does.
- tp: heads and every expert's intermediate dimension split over the ranks; every rank
  runs every token (the latent down-projections and norms replicated), two all-reduces per
  layer.
- sp-tp-sp: tokens cut evenly (MLA stages 1 and 3, MoE with partitioned experts), heads split
  for stage 2 (worker/sequence_parallel.py); also with two token-balanced microbatches.

Per rank: the runner's prefill forward of each batch (after one warm-up), its time in
collectives (every torch.distributed call timed, an async one at its wait: time waiting for
a slower peer counts here, so busy = wall - communication is the rank's own work), the bytes
it sent, and its memory (parameters, latent cache, peak RSS). Then the simulator's projection
of the same three layouts to the paper's 16-die prefill instances (DeepSeek-R1 on CloudMatrix384).
"""

from __future__ import annotations

import os
import random
import resource
import statistics
from time import perf_counter

import torch

from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section

LAYOUTS = ("dp", "tp", "sp-tp-sp")
BLOCK = 16


def heavy_tailed_lengths(n: int, seed: int, shortest: int = 16, longest: int = 512, alpha: float = 0.9) -> list[int]:
    """n prompt lengths from a Pareto tail: most near `shortest`, a few up to `longest`."""
    rng = random.Random(seed)
    return [min(longest, int(shortest * rng.paretovariate(alpha))) for _ in range(n)]


class _CommClock:
    """Times every torch.distributed collective of this process (async ones at their wait)
    and counts the bytes this rank sends (ring all-reduce: 2 (P-1)/P of the tensor; ring
    reduce-scatter and all-to-all: (P-1)/P of the input)."""

    NAMES = ("all_reduce", "all_gather", "all_to_all_single", "reduce_scatter_single")

    def __init__(self, world: int):
        import torch.distributed as dist

        self.s, self.bytes, self.world = 0.0, 0, world
        for name in self.NAMES:
            setattr(dist, name, self._wrap(getattr(dist, name), name))

    def _wrap(self, fn, name):
        clock = self

        class Work:
            def __init__(self, work):
                self.work = work

            def wait(self):
                t0 = perf_counter()
                self.work.wait()
                clock.s += perf_counter() - t0

        def timed(*args, **kw):
            t = args[1] if name != "all_reduce" else args[0]
            size = t.numel() * t.element_size()
            p = self.world
            self.bytes += {"all_reduce": 2 * (p - 1) * size // p, "all_gather": (p - 1) * size,
                           "all_to_all_single": (p - 1) * size // p, "reduce_scatter_single": (p - 1) * size // p}[name]
            t0 = perf_counter()
            work = fn(*args, **kw)
            self.s += perf_counter() - t0
            return Work(work) if kw.get("async_op") else work

        return timed


def _requests(lengths: list[int], vocab: int, tag: str):
    from matrixinfer.engine.scheduler import ScheduledRequest

    g = torch.Generator().manual_seed(len(lengths))
    reqs, block = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // BLOCK)
        reqs.append(ScheduledRequest(f"{tag}-{i}", torch.randint(2, vocab, (n,), generator=g).tolist(), 0,
                                     list(range(block, block + blocks)), sample=False))
        block += blocks
    return reqs


def _rank_main(rank: int, world: int, layout: str, model_dir: str, batches: list[list[int]], repeats: int,
               microbatches: int) -> dict:
    import torch.distributed as dist

    from matrixinfer.config import ModelConfig
    from matrixinfer.model.loader import load_model
    from matrixinfer.parallel import expert_partition, get_ep_group, get_sp_group
    from matrixinfer.parallel.ep_comm import EPDispatcher, set_dispatcher
    from matrixinfer.worker.model_runner import ModelRunner

    cfg = ModelConfig.from_pretrained(model_dir)
    blocks = max(sum(-(-n // BLOCK) for n in b) for b in batches)
    cpu = torch.device("cpu")
    if layout == "tp":
        model = load_model(model_dir, dtype="float32", with_mtp=False)
        runner = ModelRunner(model, blocks, BLOCK, cpu)
    else:
        group = get_sp_group() if layout == "sp-tp-sp" else get_ep_group()
        model = load_model(model_dir, dtype="float32", with_mtp=False,
                           expert_ids=expert_partition(cfg.n_routed_experts, world)[rank])
        owner = [r for r, ids in enumerate(expert_partition(cfg.n_routed_experts, world)) for _ in ids]
        most = max(sum(b) for b in batches)
        dispatcher = EPDispatcher(group, owner, cfg.num_experts_per_tok, cfg.hidden_size, most, "float32",
                                  torch.float32)
        set_dispatcher(dispatcher)
        if layout == "dp":
            from matrixinfer.worker.data_parallel import DataParallelRunner

            runner = DataParallelRunner(model, blocks, BLOCK, cpu, group, dispatcher, microbatches=microbatches)
        else:
            from matrixinfer.worker.sequence_parallel import SequenceParallelRunner

            runner = SequenceParallelRunner(model, blocks, BLOCK, cpu, group, dispatcher, microbatches)
    clock = _CommClock(world)
    out = []
    for b, lengths in enumerate(batches):
        walls, comms, sent = [], [], []
        for rep in range(repeats + 1):  # the first run warms up
            reqs = _requests(lengths, cfg.vocab_size, f"b{b}r{rep}")
            dist.barrier()
            c0, bytes0, t0 = clock.s, clock.bytes, perf_counter()
            runner.run(reqs, 0)
            wall = perf_counter() - t0
            if hasattr(runner, "placement"):
                runner.placement.finish([r.request_id for r in reqs])
            if rep:
                walls.append(wall)
                comms.append(clock.s - c0)
                sent.append(clock.bytes - bytes0)
        i = walls.index(statistics.median(walls)) if len(walls) % 2 else 0
        out.append({"wall_s": walls[i], "comm_s": comms[i], "bytes_sent": sent[i]})
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"batches": out, "param_mb": params / 2**20, "kv_mb": runner.kv_cache.nbytes / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure(model_dir: str, layout: str, world: int, batches: list[list[int]], repeats: int,
            microbatches: int = 1) -> dict:
    """One layout at `world` ranks over every batch: per batch the slowest rank's wall time,
    tokens/s, the balance (slowest rank's busy time over the mean), communication per rank."""
    from matrixinfer.parallel.spawn import run_ranks

    kw = {"tp": world} if layout == "tp" else {"sp": world} if layout == "sp-tp-sp" else {"ep": world}
    if world == 1:
        kw = {"tp": 1}
    ranks = run_ranks(_rank_main, world, layout, model_dir, batches, repeats, microbatches, timeout=900, **kw)
    rows = []
    for b, lengths in enumerate(batches):
        per = [ranks[r]["batches"][b] for r in range(world)]
        wall = max(p["wall_s"] for p in per)
        busy = [max(1e-9, p["wall_s"] - p["comm_s"]) for p in per]
        rows.append({"tokens": sum(lengths), "prompts": len(lengths), "wall_s": wall,
                     "tokens_per_s": sum(lengths) / wall, "balance": max(busy) / statistics.mean(busy),
                     "comm_s": statistics.mean(p["comm_s"] for p in per),
                     "mb_sent_per_rank": statistics.mean(p["bytes_sent"] for p in per) / 2**20})
    mem = {k: max(ranks[r][k] for r in range(world)) for k in ("param_mb", "kv_mb", "peak_rss_mb")}
    total_tokens = sum(r["tokens"] for r in rows)
    total_wall = sum(r["wall_s"] for r in rows)
    return {"layout": layout if microbatches == 1 else f"{layout} (2 microbatches)", "ranks": world,
            "tokens_per_s": total_tokens / total_wall, "wall_s": total_wall,
            "balance": statistics.mean(r["balance"] for r in rows),
            "comm_share": sum(r["comm_s"] for r in rows) / total_wall, "comm_s": sum(r["comm_s"] for r in rows),
            "mb_sent_per_rank": sum(r["mb_sent_per_rank"] for r in rows), "batches": rows, **mem}


def overlap_lines(results: list[dict]) -> list[str]:
    """Per rank count: what two microbatches did to SP-TP-SP's time in collectives and wall time."""
    lines = []
    for world in sorted({r["ranks"] for r in results}):
        serial = next((r for r in results if r["ranks"] == world and r["layout"] == "sp-tp-sp"), None)
        mb2 = next((r for r in results if r["ranks"] == world and r["layout"].startswith("sp-tp-sp (")), None)
        if serial and mb2:
            lines.append(f"- {world} ranks: time in collectives per rank {1e3 * serial['comm_s']:.0f} -> "
                         f"{1e3 * mb2['comm_s']:.0f} ms ({100 * (1 - mb2['comm_s'] / serial['comm_s']):.0f} % "
                         f"hidden), wall {1e3 * serial['wall_s']:.0f} -> {1e3 * mb2['wall_s']:.0f} ms")
    return lines


def projection(lengths: list[int], devices: int = 16, seed: int = 0) -> list[dict]:
    """The simulator's prefill of one batch of heavy-tailed prompts (scaled to the paper's
    lengths) on a `devices`-die instance of DeepSeek-R1 on CloudMatrix384: DP, TP, SP-TP-SP."""
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model
    from matrixinfer.sim.prefill import prefill_balance

    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    bal = prefill_balance(hw, model, lengths, devices)
    tokens = sum(lengths)
    return [{"layout": name, "devices": devices, "batch_s": t, "tokens_per_s_per_die": tokens / t / devices,
             "vs_sp_tp_sp": t / bal.sptp_s}
            for name, t in (("dp", bal.dp_s), ("tp", bal.tp_s), ("sp-tp-sp", bal.sptp_s))] + [
        {"dp_balance": bal.dp_efficiency, "prompts": len(lengths), "tokens": tokens}]


def main(args) -> int:
    torch.set_num_threads(1)
    batches = [heavy_tailed_lengths(args.prompts, args.seed + b, args.shortest, args.longest)
               for b in range(args.batches)]
    print("batches (prompt lengths):", *batches, sep="\n  ")
    results = [measure(args.model, "tp", 1, batches, args.repeats) | {"layout": "one process"}]
    for world in args.ranks:
        for layout in LAYOUTS:
            results.append(measure(args.model, layout, world, batches, args.repeats))
            print(results[-1]["layout"], world, f"{results[-1]['tokens_per_s']:.0f} tok/s", flush=True)
        if args.microbatches:
            results.append(measure(args.model, "sp-tp-sp", world, batches, args.repeats, microbatches=2))
    table = markdown_table(
        ["layout", "ranks", "prefill tok/s", "slowest / mean busy", "comm share of wall", "MB sent/rank",
         "params MB/rank", "latent KV MB/rank", "peak RSS MB/rank"],
        [[r["layout"], r["ranks"], r["tokens_per_s"], r["balance"], f"{100 * r['comm_share']:.0f} %",
          r["mb_sent_per_rank"], r["param_mb"], r["kv_mb"], r["peak_rss_mb"]] for r in results])
    print(table)
    overlap = overlap_lines(results)
    print(*overlap, sep="\n")
    rng = random.Random(args.seed)
    paper = [min(32768, int(256 * rng.paretovariate(1.1))) for _ in range(args.sim_prompts)]
    proj = projection(paper, args.sim_devices)
    proj_table = markdown_table(["layout", "dies", "batch s", "tokens/s per die", "time vs SP-TP-SP"],
                                [[r["layout"], r["devices"], r["batch_s"], r["tokens_per_s_per_die"],
                                  r["vs_sp_tp_sp"]] for r in proj[:3]])
    print(proj_table)
    if args.no_write:
        return 0
    info = proj[3]
    fastest = max(results[1:], key=lambda r: r["tokens_per_s"])
    md = (f"## Prefill parallelism: DP vs TP vs SP-TP-SP\n\n"
          f"`matrixinfer bench prefill` on this machine ({os.cpu_count()} cores): the bundled model "
          f"(float32), {args.batches} batches of {args.prompts} prompts with heavy-tailed lengths (Pareto, "
          f"{args.shortest}-{args.longest} tokens: {', '.join(str(sum(b)) for b in batches)} tokens), each "
          f"layout's prefill forward over gloo ranks (1 intra-op thread each), median of {args.repeats} runs "
          f"after a warm-up. *slowest / mean busy*: per rank, wall time minus time in collectives (waiting "
          f"for a slower peer counts as communication), the slowest rank's over the mean: 1.0 is a perfect "
          f"balance. *comm share*: the ranks' mean time in collectives over the wall time.\n\n{table}\n\n"
          + (f"**Two microbatches** (SP-TP-SP, token-balanced halves interleaved, collectives async; "
             f"a negative share hidden means the interleaving cost more waiting than it hid):\n\n"
             + "\n".join(overlap) + "\n\n" if overlap else "") +
          f"**What {os.cpu_count()} CPU cores can show.** The balance and bytes columns are properties of "
          f"the layouts: DP's busiest rank runs whole prompts (placed by request count, as the engine "
          f"places them), SP-TP-SP cuts the tokens evenly, TP repeats the down-projections, norms and "
          f"router on every token on every rank. Throughput is not the paper's: each rank has one "
          f"intra-op thread (the one-process row too), so 2 ranks use both cores and 4 ranks time-share "
          f"them (with whatever else runs on the machine); gloo collectives are memory copies through "
          f"the kernel that cost about as much as a layer of the bundled model's compute (hidden 256), so "
          f"the layouts with attention collectives in every layer (TP, SP-TP-SP) pay far more for "
          f"communication, relative to compute, than NPUs linked by UB would. In this run the fastest "
          f"parallel layout was {fastest['layout']} at {fastest['ranks']} ranks. The projection below is "
          f"the simulator's, where compute dominates.\n\n"
          f"**Projected to a 16-die prefill instance** (`sim/prefill.py`: DeepSeek-R1 on CloudMatrix384, INT8, "
          f"EP16, one batch of {info['prompts']} prompts, {info['tokens']} tokens, Pareto lengths 256-32768; "
          f"DP places each prompt on the least-loaded die, mean over max die work {info['dp_balance']:.2f}):\n\n"
          f"{proj_table}\n\n![prefill](prefill.png)\n")
    write_section("prefill", md)
    save_json("prefill", {"batches": batches, "results": results, "projection": proj, "overlap": overlap})
    _plot(results, proj)
    return 0


def _plot(results: list[dict], proj: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [f"{r['layout'].replace(' (2 microbatches)', ' mb2')}\nP={r['ranks']}" for r in results]
    axes[0].bar(range(len(results)), [r["tokens_per_s"] for r in results])
    axes[0].set_title("prefill tokens/s (this CPU)")
    axes[1].bar(range(len(results)), [r["balance"] for r in results])
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_title("slowest / mean busy time per rank")
    for ax in axes[:2]:
        ax.set_xticks(range(len(results)), labels, fontsize=6, rotation=45)
    axes[2].bar([r["layout"] for r in proj[:3]], [r["tokens_per_s_per_die"] for r in proj[:3]])
    axes[2].set_title(f"projected, {proj[0]['devices']}-die instance: tokens/s per die")
    fig.tight_layout()
    fig.savefig(bench_dir() / "prefill.png", dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    from matrixinfer.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--prompts", type=int, default=12, help="prompts per batch")
    p.add_argument("--shortest", type=int, default=16)
    p.add_argument("--longest", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--microbatches", action="store_true", help="also SP-TP-SP with two microbatches")
    p.add_argument("--sim-devices", type=int, default=16)
    p.add_argument("--sim-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
