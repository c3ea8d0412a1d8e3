"""`matrixinfer bench executor`: what running ranks as processes costs, side by side in one run.

The same requests (bundled model, float32, greedy, fixed output length) through the
in-process executor, the multi-process executor at TP=1 (one worker process: the cost of the
pipe and pickling per step) and at TP=2 (two gloo ranks sharing this machine's cores).
Interleaved repeats, medians of the engine's wall-clock decode step as the engine core sees it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section

SETUPS = {"in-process (uni)": dict(distributed_executor_backend="uni"),
          "multi-process TP=1": dict(distributed_executor_backend="mp"),
          "multi-process TP=2": dict(tensor_parallel_size=2)}


@dataclass
class ExecutorRow:
    setup: str
    decode_step_ms: float
    tokens_per_s: float
    vs_in_process: float  # decode step time / in-process decode step time


def _measure(model: str, kwargs: dict, prompts, output_len: int, dtype: str) -> tuple[float, float]:
    from matrixinfer import LLM, SamplingParams

    with LLM(model=model, dtype=dtype, max_num_seqs=max(64, len(prompts)), **kwargs) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        engine, steps = llm.engine, []
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", p, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            decode = not engine.scheduler.waiting and all(r.num_uncomputed == 1 for r in engine.scheduler.running)
            t = time.perf_counter()
            engine.step()
            if decode and len(engine.scheduler.running) == len(prompts):
                steps.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
    return statistics.median(steps), len(prompts) * output_len / elapsed


def main(args) -> int:
    from matrixinfer.config import ModelConfig

    torch.set_num_threads(args.threads)
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (args.input_len,), generator=g).tolist()}
               for _ in range(args.requests)]
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in SETUPS}
    with tqdm(total=args.repeats * len(SETUPS), desc="bench executor") as bar:
        for _ in range(args.repeats):
            for name, kw in SETUPS.items():
                samples[name].append(_measure(args.model, kw, prompts, args.output_len, args.dtype))
                bar.update(1)
    base = statistics.median(s for s, _ in samples["in-process (uni)"])
    rows = []
    for name, vals in samples.items():
        step = statistics.median(s for s, _ in vals)
        rows.append(ExecutorRow(name, step * 1e3, statistics.median(t for _, t in vals), step / base))
    table = markdown_table(["executor", "decode step ms", "output tok/s", "step vs in-process"],
                           [[r.setup, r.decode_step_ms, r.tokens_per_s, f"{r.vs_in_process:.3f}x"] for r in rows])
    print(table)
    if not args.no_write:
        md = (f"## Executors: in-process vs ranks as processes\n\n`matrixinfer bench executor` on the bundled model, "
              f"{args.dtype}, {args.requests} requests of {args.input_len} + {args.output_len} tokens, "
              f"{args.threads} threads ({os.cpu_count()} cores on this machine; at TP=2 the two ranks share them), "
              f"{args.repeats} interleaved repeats, medians. The decode step is timed by the engine core around "
              f"`step()`, so the multi-process rows include pickling the scheduler output and the pipe round trip."
              f"\n\n{table}\n")
        write_section("executor", md)
        save_json("executor", {"rows": [asdict(r) for r in rows], "requests": args.requests,
                               "input_len": args.input_len, "output_len": args.output_len, "dtype": args.dtype})
        _plot(rows)
    return 0


def _plot(rows: list[ExecutorRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.setup for r in rows], [r.decode_step_ms for r in rows], color=["#4477aa", "#66ccee", "#228833"])
    ax.set_ylabel("decode step (ms)")
    ax.set_title("same requests, three executors")
    fig.tight_layout()
    fig.savefig(bench_dir() / "executor.png", dpi=110)


def add_arguments(p) -> None:
    from matrixinfer.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
