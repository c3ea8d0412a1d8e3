"""`matrixinfer bench engine --batch-invariant`: the batch-invariant mode (model/batch_invariant.py)
against the default, same checkpoint, dtype, threads and requests, in one process run.

Reports each mode's output tokens/s, decode step and prefill time, their ratios (the mode's
cost), and what the mode buys: for how many requests the greedy tokens of the batch equal the
same request run alone on the same engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from matrixinfer.bench.engine_bench import _display_path, _median, _requests, run_matrixinfer
from matrixinfer.bench.ops_bench import cpu_info
from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section


@dataclass
class InvarianceResult:
    model: str
    dtype: str
    threads: int
    requests: int
    input_len: int
    output_len: int
    default_tokens_per_s: float
    invariant_tokens_per_s: float
    default_step_ms: float
    invariant_step_ms: float
    step_ratio: float  # invariant / default decode step time: the mode's cost
    default_prefill_ms: float
    invariant_prefill_ms: float
    default_solo_equal: float  # share of requests whose batched greedy tokens equal their solo run's
    invariant_solo_equal: float
    repeats: int
    cpu: dict


def _solo_equal(llm, prompts: list[list[int]], tokens: list[list[int]], output_len: int, label: str) -> float:
    """The share of prompts whose greedy tokens alone equal `tokens` (from the batch run)."""
    from matrixinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    same = 0
    for prompt, batched in tqdm(list(zip(prompts, tokens)), desc=f"{label}: each request alone", unit="req"):
        solo = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        same += list(solo) == list(batched)
    return same / len(prompts)


def run(model_dir: str, requests: list[int], input_len: int, output_len: int, dtype: str, threads: int,
        repeats: int = 3, max_num_batched_tokens: int = 2048) -> list[InvarianceResult]:
    """One engine per mode (compiled once, both in this process), each request count run by
    both `repeats` times, interleaved; medians. The solo check runs after the last round."""
    torch.set_num_threads(threads)
    from matrixinfer import LLM
    from matrixinfer.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    limits = dict(max_num_seqs=max(requests), max_num_batched_tokens=max(max_num_batched_tokens, input_len * 4))
    llms = {invariant: LLM(model=model_dir, dtype=dtype, batch_invariant=invariant, **limits)
            for invariant in (False, True)}
    results = []
    try:
        for n in requests:
            prompts = _requests(n, input_len, cfg.vocab_size)
            warm = _requests(n, input_len, cfg.vocab_size, seed=1)
            runs, solo = {False: [], True: []}, {}
            for i in range(repeats):
                for invariant, llm in llms.items():
                    mi = run_matrixinfer(model_dir, dtype, prompts, output_len, False, warm_prompts=warm, llm=llm)
                    runs[invariant].append((mi.seconds, mi.decode_step_s, mi.prefill_s))
                    if i == repeats - 1:
                        label = "batch-invariant" if invariant else "default"
                        solo[invariant] = _solo_equal(llm, prompts, mi.tokens, output_len, label)
            med = {k: [_median([r[j] for r in v]) for j in range(3)] for k, v in runs.items()}
            n_out = n * output_len
            results.append(InvarianceResult(
                model=_display_path(model_dir), dtype=dtype, threads=threads, requests=n, input_len=input_len,
                output_len=output_len, default_tokens_per_s=n_out / med[False][0],
                invariant_tokens_per_s=n_out / med[True][0], default_step_ms=med[False][1] * 1e3,
                invariant_step_ms=med[True][1] * 1e3, step_ratio=med[True][1] / med[False][1],
                default_prefill_ms=med[False][2] * 1e3, invariant_prefill_ms=med[True][2] * 1e3,
                default_solo_equal=solo[False], invariant_solo_equal=solo[True], repeats=repeats, cpu=cpu_info()))
            r = results[-1]
            print(f"{n} requests, {input_len}+{output_len}, {dtype}: step {r.default_step_ms:.2f} -> "
                  f"{r.invariant_step_ms:.2f} ms ({r.step_ratio:.2f}x), batch = solo {100 * r.default_solo_equal:.0f} "
                  f"% -> {100 * r.invariant_solo_equal:.0f} %", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    return results


def report(results: list[InvarianceResult], name: str) -> None:
    rows = [[r.requests, r.input_len, r.output_len, r.dtype, r.threads, r.default_tokens_per_s,
             r.invariant_tokens_per_s, r.default_step_ms, r.invariant_step_ms, f"{r.step_ratio:.2f}x",
             r.default_prefill_ms, r.invariant_prefill_ms, f"{100 * r.default_solo_equal:.0f} %",
             f"{100 * r.invariant_solo_equal:.0f} %"] for r in results]
    table = markdown_table(["requests", "input", "output", "dtype", "threads", "default tok/s",
                            "invariant tok/s", "default step ms", "invariant step ms", "step invariant / default",
                            "default prefill ms", "invariant prefill ms", "default: batch = solo",
                            "invariant: batch = solo"], rows)
    cpu = results[-1].cpu
    md = (f"## Batch-invariant mode vs the default\n\n`matrixinfer bench engine --batch-invariant` on "
          f"`{results[-1].model}`: the same engine (compiled decode step, multi-step decode) with and without "
          f"`--batch-invariant`, same requests (random token ids), dtype and threads; greedy, `ignore_eos`; each "
          f"mode {results[-1].repeats} times, interleaved, medians. `batch = solo`: the share of requests whose "
          f"greedy tokens in the batch equal the same request run alone on the same engine. CPU: {cpu['cpu']}, "
          f"torch kernel path `{cpu['torch_cpu_capability']}`; bfloat16 GEMMs {cpu.get('bf16_gemms', '?')}.\n\n"
          f"{table}\n\n![batch invariant]({name}.png)\n")
    write_section(name, md)
    save_json(name, {"results": [asdict(r) for r in results]})
    _plot(results, name)


def _plot(results: list[InvarianceResult], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype in sorted({r.dtype for r in results}):
        rs = sorted((r for r in results if r.dtype == dtype), key=lambda r: r.requests)
        x = [r.requests for r in rs]
        ax.plot(x, [r.default_step_ms for r in rs], marker="o", label=f"default, {dtype}")
        ax.plot(x, [r.invariant_step_ms for r in rs], marker="s", linestyle="--", label=f"batch-invariant, {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode step ms")
    ax.set_title(f"decode step, {results[0].input_len} in + {results[0].output_len} out, {results[0].threads} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(bench_dir() / f"{name}.png", dpi=110)


def main(args) -> int:
    if len(args.input_len) != len(args.output_len):
        raise ValueError("--input-len and --output-len take the same number of values (they pair up)")
    name = "batch-invariant" if args.name == "engine" else args.name
    results = []
    for input_len, output_len in zip(args.input_len, args.output_len):
        results += run(args.model, args.requests, input_len, output_len, args.dtype, args.threads, args.repeats,
                       args.max_num_batched_tokens)
    if not args.no_write:
        report(results, name)
    if args.json:
        print(json.dumps(asdict(results[-1])))
    return 0
