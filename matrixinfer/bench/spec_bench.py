"""`matrixinfer bench spec`: the same requests with and without MTP speculative decoding.

Prompts are windows of the model's held-out corpus files (code the bundled model did not train
on), greedy, `ignore_eos`, exactly `output_len` tokens each. For each batch size (concurrent
sequences) and each setting (no speculation, MTP with k drafts) the engine runs the requests
`repeats` times, interleaved; medians shown. At least 8 prompts run at every batch size (a
closed loop: at batch 1 they run one after another), so that acceptance is not one prompt's. Decode tokens/s counts the tokens of the steps
in which every sequence decodes (prefill excluded); TPOT is per request, (last token time -
first token time) / (tokens - 1), averaged. Acceptance rate = accepted / drafted tokens;
tokens per step = 1 + accepted drafts per verification step (vLLM's mean acceptance length).
Greedy outputs with and without speculation are compared token by token.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from matrixinfer.bench.report import markdown_table, save_json, write_section


@dataclass
class SpecBenchPoint:
    batch: int
    k: int  # drafts per step (0: no speculation)
    decode_tokens_per_s: float
    decode_tokens_per_cpu_s: float  # the same tokens over this process's CPU time (other load on the machine excluded)
    tpot_ms: float
    acceptance_rate: float
    tokens_per_step: float
    accepted_per_pos: list
    identical_to_no_spec: bool
    seconds: float


def corpus_prompts(tokenizer, n: int, input_len: int) -> list[list[int]]:
    """n prompts of input_len tokens from the held-out corpus files (one window per file, cycling)."""
    from matrixinfer.train.corpus import read_heldout_list, read_texts

    texts = [t for t in read_texts(read_heldout_list()) if len(t) > 8 * input_len]
    out = []
    for i in range(n):
        ids = tokenizer.encode(texts[i % len(texts)], add_special_tokens=False)
        start = (i // len(texts)) * input_len % max(1, len(ids) - input_len)
        out.append(ids[start:start + input_len])
    return out


def run_once(llm, prompts: list[list[int]], output_len: int, concurrency: int):
    """Closed loop: `concurrency` sequences at a time, the next prompt joining as one finishes.
    -> (token ids per prompt, (decode tokens per s, per CPU s), mean TPOT s, seconds, stats delta)."""
    engine = llm.engine
    before = engine.stats
    pending = list(enumerate(prompts))[::-1]

    def admit():
        i, p = pending.pop()
        engine.add_request(f"spec-{i}", {"prompt_token_ids": p}, _greedy(output_len))

    for _ in range(min(concurrency, len(prompts))):
        admit()
    first, last, tokens, ids = {}, {}, {}, {}
    decode_s = decode_cpu_s = decode_tokens = 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        all_decode = not sched.waiting and all(r.num_uncomputed == 1 for r in sched.running)
        t, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        now, cpu = time.perf_counter(), time.process_time()
        gained = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            gained += n - tokens.get(o.request_id, 0)
            tokens[o.request_id] = n
            ids[o.request_id] = o.outputs[0].token_ids
            if o.finished and pending:
                admit()
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
        if all_decode:
            decode_s += now - t
            decode_cpu_s += cpu - c
            decode_tokens += gained
    elapsed = time.perf_counter() - start
    tpot = sum((last[r] - first[r]) / max(1, tokens[r] - 1) for r in tokens) / len(tokens)
    after = engine.stats
    delta = {k: getattr(after, k) - getattr(before, k)
             for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}
    per_pos = list(after.spec_accepted_per_pos)
    prev = list(before.spec_accepted_per_pos) + [0] * len(per_pos)
    delta["per_pos"] = [a - b for a, b in zip(per_pos, prev)]
    rate = (decode_tokens / decode_s, decode_tokens / decode_cpu_s) if decode_s and decode_cpu_s else (float("nan"),) * 2
    return [ids[f"spec-{i}"] for i in range(len(prompts))], rate, tpot, elapsed, delta


def run(model: str, batches: list[int], ks: list[int], input_len: int, output_len: int, dtype: str,
        repeats: int, min_prompts: int = 8) -> list[SpecBenchPoint]:
    from matrixinfer import LLM

    # every side eager: speculative steps do not run the compiled decode step yet, so this
    # measures the speculation lever alone (bench engine measures the compiled step)
    llms = {k: LLM(model=model, dtype=dtype, max_num_seqs=max(batches), enforce_eager=True,
                   **({"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} if k else {}))
            for k in [0, *ks]}
    prompts_all = corpus_prompts(llms[0].get_tokenizer(), max(*batches, min_prompts), input_len)
    for llm in llms.values():  # warm up
        llm.generate([{"prompt_token_ids": prompts_all[0]}], _greedy(4), use_tqdm=False)
    points = []
    for batch in batches:
        prompts = prompts_all[:max(batch, min_prompts)]
        runs: dict[int, list] = {k: [] for k in llms}
        outputs: dict[int, list] = {}
        for _ in range(repeats):
            for k, llm in llms.items():
                outputs[k], tok_s, tpot, elapsed, delta = run_once(llm, prompts, output_len, batch)
                runs[k].append((tok_s, tpot, elapsed, delta))
        for k, rs in runs.items():
            med = sorted(rs, key=lambda r: r[0][0])[len(rs) // 2]
            cpu_rate = sorted(r[0][1] for r in rs)[len(rs) // 2]
            d = med[3]
            drafts, draft_tokens = d["spec_num_drafts"], d["spec_num_draft_tokens"]
            points.append(SpecBenchPoint(
                batch, k, med[0][0], cpu_rate, med[1] * 1e3,
                d["spec_num_accepted_tokens"] / draft_tokens if draft_tokens else 0.0,
                1 + d["spec_num_accepted_tokens"] / drafts if drafts else 1.0, d["per_pos"],
                outputs[k] == outputs[0], med[2]))
            p = points[-1]
            print(f"batch {batch} k={k}: decode {p.decode_tokens_per_s:.1f} tok/s ({p.decode_tokens_per_cpu_s:.1f} per CPU s), TPOT {p.tpot_ms:.2f} ms, "
                  f"acceptance {p.acceptance_rate:.3f}, tokens/step {p.tokens_per_step:.2f}, "
                  f"identical {p.identical_to_no_spec}", flush=True)
    return points


def _greedy(output_len: int):
    from matrixinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def report(points: list[SpecBenchPoint], model: str, input_len: int, output_len: int, threads: int,
           repeats: int) -> None:
    base = {p.batch: p for p in points if p.k == 0}
    rows = [[p.batch, p.k or "off", p.acceptance_rate if p.k else "-", p.tokens_per_step, p.decode_tokens_per_s,
             f"{p.decode_tokens_per_s / base[p.batch].decode_tokens_per_s:.2f}x", p.decode_tokens_per_cpu_s,
             f"{p.decode_tokens_per_cpu_s / base[p.batch].decode_tokens_per_cpu_s:.2f}x", p.tpot_ms,
             "yes" if p.identical_to_no_spec else "NO"] for p in points]
    table = markdown_table(["sequences", "MTP drafts k", "acceptance", "tokens/step", "decode tok/s", "vs off",
                            "decode tok/CPU-s", "vs off", "TPOT ms", "greedy output identical"], rows)
    md = (f"## Speculative decoding: MTP drafts vs none\n\n"
          f"`matrixinfer bench spec` on `{model}`: {input_len}-token windows of the held-out corpus files, "
          f"{output_len} greedy tokens each (at least 8 prompts per point, in a closed loop of `sequences` "
          f"concurrent ones), {threads} thread(s), each setting run {repeats} times, interleaved, "
          f"medians shown. Decode tok/s counts only steps in which every sequence decodes; per CPU-s divides "
          f"the same tokens by this process's CPU time in those steps (one thread: the work, without the wait "
          f"for cores other processes hold on this shared machine).\n\n{table}\n\n"
          f"![spec](spec.png)\n")
    write_section("spec", md)
    save_json("spec", {"model": model, "input_len": input_len, "output_len": output_len, "threads": threads,
                       "points": [asdict(p) for p in points]})
    plot(points)


def plot(points: list[SpecBenchPoint]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matrixinfer.bench.report import bench_dir

    batches = sorted({p.batch for p in points})
    ks = sorted({p.k for p in points})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        ps = {p.batch: p for p in points if p.k == k}
        x = [i + (j - (len(ks) - 1) / 2) * width for i in range(len(batches))]
        label = f"MTP k={k}" if k else "no speculation"
        a.bar(x, [ps[n].decode_tokens_per_s for n in batches], width, label=label)
        b.bar(x, [ps[n].tpot_ms for n in batches], width, label=label)
    for ax, ylabel in ((a, "decode tokens/s"), (b, "TPOT (ms)")):
        ax.set_xticks(range(len(batches)), [f"{n} seq" for n in batches])
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(bench_dir() / "spec.png", dpi=110)


def add_arguments(p) -> None:
    from matrixinfer.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="concurrent sequences")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[1, 2], help="k values to compare with off")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the points as one JSON line")


def main(args) -> int:
    torch.set_num_threads(args.threads)
    points = run(args.model, args.batches, args.num_speculative_tokens, args.input_len, args.output_len, args.dtype,
                 args.repeats)
    from matrixinfer.bench.engine_bench import _display_path

    report(points, _display_path(args.model), args.input_len, args.output_len, args.threads, args.repeats)
    if args.json:
        print(json.dumps([asdict(p) for p in points]))
    return 0
