"""`matrixinfer bench kv-connector`: what the EMS connector buys, side by side in one run.

1. Page layout: one EMS object per block holding every layer (what the connector stores)
   against one object per (block, layer), for the bundled model's latent geometry and
   DeepSeek-V3's (61 layers x 576 values); put (durable: fsync before ack) and get times.
2. The engine: time to first token of the same long prompt computed from scratch, served
   from this engine's own prefix cache, and loaded from EMS by a second engine instance
   that has never seen it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section

GEOMETRIES = {"matrixinfer-tiny-moe (5 layers x 80, bf16)": (5, 80), "DeepSeek-V3 (61 layers x 576, bf16)": (61, 576)}


@dataclass
class LayoutRow:
    geometry: str
    layout: str
    objects: int
    put_ms: float
    get_ms: float


@dataclass
class TTFTRow:
    source: str
    ttft_ms: float
    cached_tokens: int
    vs_recompute: float


def _layout_rows(controller: str, blocks: int, block_size: int, repeats: int) -> list[LayoutRow]:
    from matrixinfer.ems.client import EMSClient

    client = EMSClient(controller, namespace="bench-kv")
    rows = []
    try:
        for name, (layers, dim) in GEOMETRIES.items():
            page = torch.randn(layers, block_size, dim).to(torch.bfloat16)
            for layout in ("per block", "per layer"):
                puts, gets = [], []
                for r in range(repeats):
                    tag = f"{layout[4:]}-{layers}-{r}-{time.monotonic_ns()}"
                    if layout == "per block":
                        items = [(f"{tag}-{b}", page) for b in range(blocks)]
                    else:
                        items = [(f"{tag}-{b}-{l}", page[l]) for b in range(blocks) for l in range(layers)]
                    t = time.perf_counter()
                    client.put_many(items)
                    puts.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    values = client.get_many([k for k, _ in items])
                    gets.append(time.perf_counter() - t)
                    assert all(v is not None for v in values), "the pool lost a value: make --dram-mb larger"
                rows.append(LayoutRow(name, layout, len(items), statistics.median(puts) * 1e3,
                                      statistics.median(gets) * 1e3))
    finally:
        client.close()
    return rows


def _ttft(llm, prompt) -> tuple[float, int]:
    from matrixinfer import SamplingParams

    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens


def _ttft_rows(model: str, controller: str, prompt_len: int, dtype: str, repeats: int) -> list[TTFTRow]:
    from matrixinfer import LLM
    from matrixinfer.config import ModelConfig

    vocab = ModelConfig.from_pretrained(model).vocab_size
    kv = {"connector": "ems", "ems_controller": controller}
    samples: dict[str, list[tuple[float, int]]] = {"recompute (no cache)": [], "local prefix cache": [],
                                                   "EMS, another instance": []}
    for r in range(repeats):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=torch.Generator().manual_seed(r)).tolist()
        with LLM(model=model, dtype=dtype, kv_transfer_config=kv) as a:
            samples["recompute (no cache)"].append(_ttft(a, prompt))  # computes and saves to EMS
            samples["local prefix cache"].append(_ttft(a, prompt))
        with LLM(model=model, dtype=dtype, kv_transfer_config=kv) as b:
            samples["EMS, another instance"].append(_ttft(b, prompt))
    base = statistics.median(s for s, _ in samples["recompute (no cache)"])
    return [TTFTRow(k, statistics.median(s for s, _ in v) * 1e3, min(c for _, c in v),
                    statistics.median(s for s, _ in v) / base) for k, v in samples.items()]


def main(args) -> int:
    from matrixinfer.ems import LocalCluster

    torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="bench-kv-")
    cluster = LocalCluster(n_servers=args.servers, root=root, dram_bytes=args.dram_mb << 20)
    try:
        cluster.start()
        with tqdm(total=2, desc="bench kv-connector") as bar:
            layout = _layout_rows(cluster.controller, args.blocks, args.block_size, args.repeats)
            bar.update(1)
            ttft = _ttft_rows(args.model, cluster.controller, args.prompt_len, args.dtype, args.repeats)
            bar.update(1)
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    t1 = markdown_table(["geometry", "layout", "objects", "put ms", "get ms"],
                        [[r.geometry, r.layout, r.objects, r.put_ms, r.get_ms] for r in layout])
    t2 = markdown_table(["prompt KV from", "TTFT ms", "cached tokens", "vs recompute"],
                        [[r.source, r.ttft_ms, r.cached_tokens, f"{r.vs_recompute:.2f}x"] for r in ttft])
    print(t1 + "\n\n" + t2)
    md = (f"## KV connector: EMS page layout and time to first token\n\n`matrixinfer bench kv-connector`: a local "
          f"EMS pool of {args.servers} MP server(s) (durable puts, same-host reads), {args.blocks} blocks of "
          f"{args.block_size} tokens, medians of {args.repeats}. One object per block is what the EMS connector "
          f"stores.\n\n{t1}\n\nTime to first token of one {args.prompt_len}-token prompt (bundled model, "
          f"{args.dtype}, {args.threads} threads, max_tokens=1), the same engine configuration on every row:"
          f"\n\n{t2}\n\n![kv-connector](kv-connector.png)\n")
    write_section("kv-connector", md)
    save_json("kv-connector", {"layout": [asdict(r) for r in layout], "ttft": [asdict(r) for r in ttft]})
    _plot(layout, ttft)
    return 0


def _plot(layout: list[LayoutRow], ttft: list[TTFTRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r.geometry.split(' (')[0]}\n{r.layout}" for r in layout]
    x = range(len(layout))
    a.bar([i - 0.2 for i in x], [r.put_ms for r in layout], 0.4, label="put (durable)")
    a.bar([i + 0.2 for i in x], [r.get_ms for r in layout], 0.4, label="get")
    a.set_xticks(list(x), labels, fontsize=8)
    a.set_ylabel("ms for all blocks")
    a.legend()
    b.bar([r.source for r in ttft], [r.ttft_ms for r in ttft], color=["#999999", "#4477aa", "#228833"])
    b.set_ylabel("time to first token (ms)")
    fig.tight_layout()
    fig.savefig(bench_dir() / "kv-connector.png", dpi=110)


def add_arguments(p) -> None:
    from matrixinfer.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--dram-mb", type=int, default=512)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--repeats", type=int, default=3)
