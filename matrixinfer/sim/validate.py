"""`matrixinfer simulate validate`: the real engine on this machine against the cost model.

For every (batch, prompt length) the engine's public API runs `generate` twice: with
max_tokens = 1 (prefill only) and max_tokens = N. Measured, from wall clocks and the
requests' metrics:
  TTFT         mean of first_token_time - arrival_time over the requests of the N run
  decode step  (time of the N run - time of the 1 run) / (N - 1)
  throughput   batch x N output tokens / time of the N run
Predicted by sim/local.py from a hardware YAML (normally the one `matrixinfer bench ops`
wrote on this machine) and the model's config.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from matrixinfer.sim import local
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec

PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Row:
    batch: int
    prompt_len: int
    max_tokens: int
    measured_decode_step_ms: float
    predicted_decode_step_ms: float
    measured_ttft_ms: float
    predicted_ttft_ms: float
    measured_tokens_per_s: float
    predicted_tokens_per_s: float

    def rel_errors(self) -> dict:
        return {k: abs(getattr(self, f"predicted_{k}") / getattr(self, f"measured_{k}") - 1)
                for k in ("decode_step_ms", "ttft_ms", "tokens_per_s")}


def measure(llm, batch: int, prompt_len: int, max_tokens: int, repeats: int = 3) -> tuple[float, float, float]:
    """(decode step s, TTFT s, output tokens/s) of the real engine; fastest of `repeats`."""
    from matrixinfer import SamplingParams

    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 1000 + 3 for j in range(prompt_len)]} for i in range(batch)]

    def run(n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t0
        if any(len(o.outputs[0].token_ids) != n for o in outs):
            raise RuntimeError(f"engine returned fewer than {n} tokens (ignore_eos not honoured?)")
        ttft = sum(o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs) / len(outs)
        return wall, ttft

    run(2)  # warm-up: allocations and first-call paths
    one = min(run(1)[0] for _ in range(repeats))
    full = min((run(max_tokens) for _ in range(repeats)), key=lambda r: r[0])
    return (full[0] - one) / (max_tokens - 1), full[1], batch * max_tokens / full[0]


def validate(hw: HardwareSpec, model: ModelSpec, model_dir: str, dtype: str, batches: list[int],
             prompt_lens: list[int], max_tokens: int, progress=None) -> list[Row]:
    from matrixinfer import LLM

    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2 to time decode steps")
    prec = PRECISION[dtype]
    llm = LLM(model=model_dir, dtype=dtype, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * (max(prompt_lens) + max_tokens), enable_prefix_caching=False)
    rows = []
    for b in batches:
        for p in prompt_lens:
            step, ttft, tps = measure(llm, b, p, max_tokens)
            pred = local.generate_run(hw, model, b, p, max_tokens, prec)
            rows.append(Row(b, p, max_tokens, 1e3 * step, 1e3 * pred.decode_step_s, 1e3 * ttft, 1e3 * pred.ttft_s,
                            tps, pred.throughput_tok_s))
            if progress:
                progress()
    return rows


def summary(rows: list[Row]) -> dict:
    errs = [e for r in rows for e in r.rel_errors().values()]
    return {"rows": [asdict(r) | {"rel_error": r.rel_errors()} for r in rows], "max_rel_error": max(errs)}


def plot(rows: list[Row], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("decode_step_ms", "ttft_ms", "tokens_per_s"),
                              ("decode step (ms)", "TTFT (ms)", "output tokens/s")):
        m = [getattr(r, f"measured_{key}") for r in rows]
        p = [getattr(r, f"predicted_{key}") for r in rows]
        ax.scatter(m, p)
        for r, x, y in zip(rows, m, p):
            ax.annotate(f"b{r.batch}/{r.prompt_len}", (x, y), fontsize=7)
        lo, hi = min(m + p) * 0.8, max(m + p) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15, label="±15 %")
        ax.set(xscale="log", yscale="log", xlabel=f"measured {label}", ylabel=f"predicted {label}")
        ax.legend(fontsize=7)
    fig.suptitle("simulate validate: real engine on this machine vs the cost model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
