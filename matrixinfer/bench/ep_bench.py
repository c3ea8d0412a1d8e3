"""`matrixinfer bench ep`: expert parallelism on this machine, and projected to EP320.

1. Dispatch / combine: gloo ranks (EP 2 and 4) each holding their share of the bundled model's
   experts (bfloat16), one MoE layer's fused dispatch + combine on random tokens, INT8 vs BF16
   rows: bytes per token (the row format and the measured destinations per token) and the
   latency of each exchange (median over calls, ranks aligned by a barrier before each).
2. EPLB: tokens per rank, max / mean, before (contiguous partition) and after (R redundant
   experts placed by parallel/eplb.py) on the bundled model's own routing of Python source
   (2048 tokens of the standard library's textwrap and argparse), per MoE layer, and on a
   Zipf-skewed synthetic router at DeepSeek scale.
3. Decode: the engine's decode step at EP 1 and EP 2 (INT8 and BF16 dispatch), same requests.
4. The simulator's projection of the same configuration to EP320 on CloudMatrix384.
"""

from __future__ import annotations

import os
import random
import statistics
from dataclasses import asdict, dataclass

import torch

from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section


@dataclass
class CommRow:
    ep: int
    dtype: str
    tokens_per_rank: int
    row_bytes: int
    dests_per_token: float  # ranks a token is sent to (distinct ranks of its top-k experts)
    bytes_per_token: float  # row_bytes x dests_per_token
    wire_bytes_per_rank: int  # what one exchange moves per rank (ep x step_tokens rows, padding included)
    dispatch_us: float
    combine_us: float


def _comm_rank(rank: int, world: int, model_dir: str, token_counts: list[int], iters: int) -> list[dict]:
    import torch.distributed as dist

    from matrixinfer.model.loader import load_model
    from matrixinfer.model.moe import MoE
    from matrixinfer.parallel import expert_partition, get_ep_group
    from matrixinfer.parallel.ep_comm import EPDispatcher

    group = get_ep_group()
    cfg_n = _num_experts(model_dir)
    model = load_model(model_dir, dtype="bfloat16", expert_ids=expert_partition(cfg_n, world)[rank], with_mtp=False)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    cfg = model.config
    owner = [r for r, ids in enumerate(expert_partition(cfg_n, world)) for _ in ids]
    out = []
    g = torch.Generator().manual_seed(rank)
    for dtype in ("int8", "bfloat16"):
        d = EPDispatcher(group, owner, cfg.num_experts_per_tok, cfg.hidden_size, max(token_counts), dtype,
                         torch.bfloat16, timed=True)
        for n in token_counts:
            d.set_step_tokens(n)
            times = []
            rows = tokens = 0
            with torch.inference_mode():
                for i in range(iters + 3):
                    x = torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16)
                    w, ids = moe.gate(x)
                    dist.barrier(group=group.group)
                    before = (d.stats.dispatch_s, d.stats.combine_s, d.stats.rows_sent, d.stats.tokens)
                    d(x, w, ids, moe.experts)
                    if i >= 3:  # warm-up calls left out
                        times.append((d.stats.dispatch_s - before[0], d.stats.combine_s - before[1]))
                        rows += d.stats.rows_sent - before[2]
                        tokens += d.stats.tokens - before[3]
            out.append(dict(dtype=dtype, n=n, row_bytes=d.layout.row_bytes, dests=rows / tokens,
                            dispatch_us=statistics.median(t[0] for t in times) * 1e6,
                            combine_us=statistics.median(t[1] for t in times) * 1e6,
                            wire=world * n * d.layout.row_bytes))
    return out


def _num_experts(model_dir: str) -> int:
    from matrixinfer.config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).n_routed_experts


def comm_rows(model_dir: str, eps: list[int], token_counts: list[int], iters: int) -> list[CommRow]:
    from matrixinfer.parallel.spawn import run_ranks

    rows = []
    for ep in eps:
        per_rank = run_ranks(_comm_rank, ep, model_dir, token_counts, iters, ep=ep, timeout=600)
        for i, r in enumerate(per_rank[0]):
            # a collective's latency is its slowest rank's
            disp = max(per_rank[k][i]["dispatch_us"] for k in per_rank)
            comb = max(per_rank[k][i]["combine_us"] for k in per_rank)
            dests = statistics.mean(per_rank[k][i]["dests"] for k in per_rank)
            rows.append(CommRow(ep, r["dtype"], r["n"], r["row_bytes"], dests, r["row_bytes"] * dests, r["wire"],
                                disp, comb))
    return rows


# ---------------------------------------------------------------- microbatch overlap

def _overlap_rank(rank: int, world: int, model_dir: str, seqs: int, seq_len: int, iters: int) -> dict:
    import time

    import torch.distributed as dist

    from matrixinfer.model.loader import load_model
    from matrixinfer.model.moe import run_stages
    from matrixinfer.parallel import expert_partition, get_ep_group
    from matrixinfer.parallel.ep_comm import EPDispatcher, set_dispatcher
    from matrixinfer.worker.data_parallel import run_microbatches

    group = get_ep_group()
    n = _num_experts(model_dir)
    model = load_model(model_dir, dtype="bfloat16", expert_ids=expert_partition(n, world)[rank], with_mtp=False)
    cfg = model.config
    owner = [r for r, ids in enumerate(expert_partition(n, world)) for _ in ids]
    d = EPDispatcher(group, owner, cfg.num_experts_per_tok, cfg.hidden_size, seqs * seq_len, "int8", torch.bfloat16,
                     timed=True)
    set_dispatcher(d)
    ids = torch.randint(10, cfg.vocab_size, (seqs, seq_len), generator=torch.Generator().manual_seed(rank))
    pos = torch.arange(seq_len).expand(seqs, seq_len)
    half = seqs // 2
    out = {}
    with torch.inference_mode():
        for mode in ("serial", "2 microbatches") * (iters + 1):
            dist.barrier(group=group.group)
            wait0 = d.stats.dispatch_s + d.stats.combine_s
            t = time.perf_counter()
            if mode == "serial":
                d.set_step_tokens(seqs * seq_len)
                run_stages(model.model.stages(ids, pos))
            else:
                parts = [(model.model.stages(ids[:half], pos[:half]), None),
                         (model.model.stages(ids[half:], pos[half:]), None)]
                run_microbatches(parts, [half * seq_len, (seqs - half) * seq_len], d)
            out.setdefault(mode, []).append((time.perf_counter() - t, d.stats.dispatch_s + d.stats.combine_s - wait0))
    return {m: (statistics.median(s for s, _ in v[1:]), statistics.median(w for _, w in v[1:])) for m, v in out.items()}


def overlap_rows(model_dir: str, ep: int, seqs: int, seq_len: int, iters: int) -> list[dict]:
    """Forward time and the time spent waiting on exchanges, serial vs two microbatches (the
    slowest rank's medians); hidden = the share of the serial wait that the overlap removes."""
    from matrixinfer.parallel.spawn import run_ranks

    per_rank = run_ranks(_overlap_rank, ep, model_dir, seqs, seq_len, iters, ep=ep, timeout=600)
    rows = []
    for mode in ("serial", "2 microbatches"):
        rows.append(dict(ep=ep, mode=mode, forward_ms=max(v[mode][0] for v in per_rank.values()) * 1e3,
                         wait_ms=max(v[mode][1] for v in per_rank.values()) * 1e3))
    rows[1]["hidden"] = 1 - rows[1]["wait_ms"] / rows[0]["wait_ms"] if rows[0]["wait_ms"] else 0.0
    rows[0]["hidden"] = 0.0
    return rows


# ---------------------------------------------------------------- EPLB

def routing_counts(model_dir: str, text: str, max_tokens: int = 2048) -> list[list[int]]:
    """Tokens per logical expert in each MoE layer when the model reads `text` (one pass,
    single process)."""
    from matrixinfer.tokenizer import Tokenizer
    from matrixinfer.model.loader import load_model
    from matrixinfer.model.moe import MoE

    model = load_model(model_dir, dtype="float32", with_mtp=False)
    ids = Tokenizer(model_dir).encode(text)[:max_tokens]
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    counts = [torch.zeros(m.experts.num_experts, dtype=torch.long) for m in moes]
    def counter(c):
        def hook(_module, _inputs, out) -> None:  # returns None: the router's output stands
            c.add_(torch.bincount(out[1].flatten(), minlength=c.numel()))
        return hook

    hooks = [m.gate.register_forward_hook(counter(c)) for m, c in zip(moes, counts)]
    with torch.inference_mode():
        for start in range(0, len(ids), 256):  # windows of 256 tokens
            chunk = torch.tensor(ids[start:start + 256])
            model(chunk[None], torch.arange(len(chunk))[None])
    for h in hooks:
        h.remove()
    return [c.tolist() for c in counts]


def eplb_rows(load: list[float], ep: int, redundant: list[int]) -> list[dict]:
    from matrixinfer.parallel.eplb import imbalance, rebalance, static_placement

    before = imbalance(static_placement(len(load), ep).rank_loads(load))
    return [dict(ep=ep, redundant=r, before=before, after=imbalance(rebalance(load, ep, r).rank_loads(load)))
            for r in redundant]


# ---------------------------------------------------------------- decode and the projection

def decode_rows(model_dir: str, requests: int, input_len: int, output_len: int, repeats: int) -> list[dict]:
    """The engine's decode step per setup: `repeats` interleaved runs, medians (this machine's
    cores are shared, so single runs wander)."""
    from matrixinfer.bench.executor_bench import _measure

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 4000, (input_len,), generator=g).tolist()}
               for _ in range(requests)]
    setups = {"EP=1 (one process)": dict(),
              "EP=2 bf16 dispatch": dict(expert_parallel_size=2, dispatch_dtype="bfloat16"),
              "EP=2 int8 dispatch": dict(expert_parallel_size=2, dispatch_dtype="int8"),
              "EP=2 int8, 2 microbatches": dict(expert_parallel_size=2, dispatch_dtype="int8", microbatches=2)}
    samples: dict[str, list] = {name: [] for name in setups}
    for _ in range(repeats):
        for name, kw in setups.items():
            samples[name].append(_measure(model_dir, dict(enable_prefix_caching=False, **kw), prompts, output_len,
                                          "bfloat16"))
    rows = []
    for name, kw in setups.items():
        step = statistics.median(s for s, _ in samples[name])
        tps = statistics.median(t for _, t in samples[name])
        ranks = kw.get("expert_parallel_size", 1)
        rows.append(dict(setup=name, step_ms=step * 1e3, tokens_per_s=tps, tokens_per_s_per_rank=tps / ranks))
    return rows


def projection(imbalance_after: float) -> dict:
    from matrixinfer.sim.costs import ep_comm
    from matrixinfer.sim.decode import DecodeConfig, decode_step
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model

    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    out = {"comm": {}, "decode": {}}
    for prec in ("int8", "bf16"):
        c = ep_comm(hw, model, 96, 320, prec, "bf16", plane=hw.ep_decode_plane, dedup_ranks=False)
        out["comm"][prec] = dict(dispatch_us=c.dispatch_s * 1e6, combine_us=c.combine_s * 1e6)
    for prec in ("int8", "bf16"):
        for mb in (1, 2):
            r = decode_step(hw, model, DecodeConfig(batch_per_device=96, kv_len=4096, ep=320, dispatch_precision=prec,
                                                    microbatches=mb, expert_imbalance=imbalance_after))
            out["decode"][f"{prec} mb{mb}"] = dict(step_ms=r.step_ms, tokens_per_s_per_device=r.tokens_per_s_per_device)
    return out


def main(args) -> int:
    from matrixinfer.sim.costs import zipf_loads

    torch.set_num_threads(1)
    comm = comm_rows(args.model, args.ep, args.tokens, args.iters)
    comm_table = markdown_table(
        ["EP", "dispatch", "tokens/rank", "row B", "ranks/token", "B/token", "wire B/rank", "dispatch us",
         "combine us"],
        [[r.ep, r.dtype, r.tokens_per_rank, r.row_bytes, r.dests_per_token, r.bytes_per_token, r.wire_bytes_per_rank,
          r.dispatch_us, r.combine_us] for r in comm])
    int8 = next(r for r in comm if r.dtype == "int8")
    bf16 = next(r for r in comm if r.dtype == "bfloat16")
    ratio = int8.row_bytes / bf16.row_bytes
    print(comm_table, f"\nINT8 / BF16 bytes per token: {ratio:.3f}\n")

    import argparse as _argparse
    import inspect
    import textwrap as _textwrap

    # the kind of text the bundled model serves (it was trained on the Python standard library)
    text = inspect.getsource(_textwrap) + inspect.getsource(_argparse)
    counts = routing_counts(args.model, text)
    real = [dict(layer=i, **row) for i, c in enumerate(counts) for ep in args.ep
            for row in eplb_rows([float(x) for x in c], ep, [ep])]
    zipf = zipf_loads(256, args.zipf)
    random.Random(0).shuffle(zipf)  # popularity is not sorted by expert id
    synthetic = eplb_rows(zipf, 32, [0, 32, 64])
    eplb_table = markdown_table(["router", "MoE layer", "EP", "redundant", "max/mean before", "max/mean after"],
                                [["bundled model, textwrap.py + argparse.py", r["layer"], r["ep"], r["redundant"],
                                  r["before"], r["after"]] for r in real]
                                + [[f"Zipf s={args.zipf}, 256 experts (shuffled)", "-", r["ep"], r["redundant"],
                                    r["before"], r["after"]] for r in synthetic])
    print(eplb_table, "\n")

    overlap = [row for ep in args.ep for row in overlap_rows(args.model, ep, 4, 16, args.iters)]
    overlap_table = markdown_table(["EP", "mode", "forward ms", "waiting on exchanges ms", "wait hidden"],
                                   [[r["ep"], r["mode"], r["forward_ms"], r["wait_ms"], f"{100 * r['hidden']:.0f} %"]
                                    for r in overlap])
    print(overlap_table, "\n")

    decode = (decode_rows(args.model, args.requests, args.input_len, args.output_len, args.repeats)
              if args.requests else [])
    decode_table = markdown_table(["setup", "decode step ms", "output tok/s", "tok/s per rank"],
                                  [[r["setup"], r["step_ms"], r["tokens_per_s"], r["tokens_per_s_per_rank"]]
                                   for r in decode])
    print(decode_table, "\n")

    proj = projection(synthetic[1]["after"])
    proj_table = markdown_table(["EP320, 96 tokens/die", "dispatch us", "combine us"],
                                [[k, v["dispatch_us"], v["combine_us"]] for k, v in proj["comm"].items()])
    proj_decode = markdown_table(["EP320 decode (batch 96/die, KV 4096)", "step ms", "tok/s per die"],
                                 [[k, v["step_ms"], v["tokens_per_s_per_device"]] for k, v in proj["decode"].items()])
    print(proj_table, "\n\n", proj_decode)
    if args.no_write:
        return 0
    md = (f"## Expert parallelism (EP): dispatch/combine, EPLB, decode\n\n"
          f"`matrixinfer bench ep` on this machine ({os.cpu_count()} cores; gloo ranks are processes sharing "
          f"them, so latencies are CPU-collective latencies, not NPU ones).\n\n"
          f"**Dispatch / combine** of one MoE layer of the bundled model (hidden {_hidden(args.model)}, bf16), "
          f"{args.iters} calls per row, median, the slowest rank's. A row = payload + routing metadata (+ the "
          f"fp32 scale for INT8); a token is sent once to each rank holding one of its experts. INT8 / BF16 "
          f"bytes per token: **{ratio:.3f}** (goal <= 0.55). The wire moves ep x tokens rows per rank (no count "
          f"exchange: empty rows are padding).\n\n{comm_table}\n\n"
          f"**EPLB**: tokens per rank, max / mean, before (contiguous partition) and after placing R redundant "
          f"experts from the counted load (parallel/eplb.py; replicas share an expert's tokens evenly).\n\n"
          f"{eplb_table}\n\n"
          f"**Microbatch overlap**: the model forward on each rank (4 sequences x 16 tokens, bf16, INT8 "
          f"dispatch), serial vs two microbatches of 2 sequences interleaved (async all_to_all); the time the "
          f"slowest rank spends waiting on exchanges, and the share of the serial wait the overlap hides. "
          f"On this CPU the 'other' microbatch competes with gloo's own threads for the same cores, which "
          f"bounds what can be hidden.\n\n{overlap_table}\n\n"
          f"**Decode step** ({args.requests} requests of {args.input_len} + {args.output_len} tokens, bf16, "
          f"{args.repeats} interleaved runs, medians of the engine's decode step; the EP ranks share this "
          f"machine's cores with each other and with whatever else runs on it):\n\n{decode_table}\n\n"
          f"**Projected to EP320 on CloudMatrix384** (the simulator's DeepEP-style dispatch/combine model, "
          f"DeepSeek-R1, 96 tokens per die; decode with the Zipf EPLB imbalance after R=32 above):\n\n"
          f"{proj_table}\n\n{proj_decode}\n")
    write_section("ep", md)
    save_json("ep", {"comm": [asdict(r) for r in comm], "int8_bf16_ratio": ratio, "eplb_real": real,
                     "eplb_zipf": synthetic, "overlap": overlap, "decode": decode, "projection": proj})
    _plot(comm, real, synthetic)
    return 0


def _hidden(model_dir: str) -> int:
    from matrixinfer.config import ModelConfig

    return ModelConfig.from_pretrained(model_dir).hidden_size


def _plot(comm: list[CommRow], real: list[dict], synthetic: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [f"EP{r.ep} {r.dtype[:4]} {r.tokens_per_rank}t" for r in comm]
    a.bar(labels, [r.dispatch_us for r in comm], label="dispatch")
    a.bar(labels, [r.combine_us for r in comm], bottom=[r.dispatch_us for r in comm], label="combine")
    a.set_ylabel("us (gloo, this machine)")
    a.tick_params(axis="x", rotation=60, labelsize=7)
    a.legend()
    a.set_title("fused dispatch + combine, one MoE layer")
    rows = real + [dict(layer="zipf", **r) for r in synthetic]
    names = [f"L{r['layer']} EP{r['ep']} R{r['redundant']}" for r in rows]
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["before"] for r in rows], width=0.4, label="before")
    b.bar([i + 0.2 for i in x], [r["after"] for r in rows], width=0.4, label="after EPLB")
    b.set_xticks(list(x), names, rotation=60, fontsize=7)
    b.set_ylabel("max / mean tokens per rank")
    b.legend()
    b.set_title("EPLB")
    fig.tight_layout()
    fig.savefig(bench_dir() / "ep.png", dpi=110)


def add_arguments(p) -> None:
    from matrixinfer.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 64], help="tokens per rank per call")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--zipf", type=float, default=1.0, help="skew of the synthetic router")
    p.add_argument("--requests", type=int, default=8, help="decode comparison (0: skip it)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of the decode comparison")
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
