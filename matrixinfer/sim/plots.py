"""Matplotlib figures of the simulator (Agg backend, written to files)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _finish(ax, xlabel: str, ylabel: str, title: str | None = None) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_decode_tradeoff(curves: dict[str, list[tuple[float, float, float]]], path: str | Path,
                         marks: dict[str, tuple[float, float]] | None = None, slos_ms=(15, 30, 50)) -> Path:
    """curves: label -> [(batch, tpot_ms, tokens/s per device)]; marks: label -> (tpot, tok/s)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in curves.items():
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker=".", label=label)
    for slo in slos_ms:
        ax.axvline(slo, color="grey", ls=":", lw=0.8)
        ax.text(slo, ax.get_ylim()[1] * 0.02, f" {slo} ms", color="grey", fontsize=8)
    for label, (x, y) in (marks or {}).items():
        ax.plot([x], [y], "k*", ms=10)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, -12), fontsize=8)
    _finish(ax, "TPOT (ms)", "decode tokens/s per device",
            "Decode throughput vs TPOT (DeepSeek-R1, 4K KV; points = batch per device)")
    return _save(fig, path)


def plot_allocation(rates: dict[int, list[tuple[float, float]]], path: str | Path) -> Path:
    """rates: supernode size -> [(mean block size, allocation rate)]."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for size, pts in sorted(rates.items()):
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=".", label=f"S = {size} NPUs")
    _finish(ax, "mean block size (NPUs)", "NPU allocation rate (%)", "Allocation rate vs mean block size")
    return _save(fig, path)


def plot_utilisation(series: list[dict], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    t = [s["t"] for s in series]
    ax.plot(t, [s["prefill_busy"] for s in series], label="prefill busy fraction")
    ax.plot(t, [s["decode_batch_fill"] for s in series], label="decode batch fill")
    ax.set_ylim(0, 1.05)
    _finish(ax, "time (s)", "fraction")
    return _save(fig, path)


def plot_faults(runs: dict[str, list[dict]], faults: dict[str, list[tuple[float, str, list]]], path: str | Path,
                window: tuple[float, float] | None = None) -> Path:
    """runs: label -> the serving time series (cumulative `output_tokens`, `decode_up`);
    faults: label -> [(t, component, instances taken down)] (marked where they took one)."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for (label, series), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        t = [s["t"] for s in series]
        rate = [(b["output_tokens"] - a["output_tokens"]) / (b["t"] - a["t"]) / 1e3 for a, b in zip(series, series[1:])]
        ax.plot(t[1:], rate, lw=0.9, color=color, label=label)
        ax2.plot(t, [s["decode_up"] for s in series], lw=0.9, color=color)
        for ft, _, hit in faults.get(label, []):
            if any(h.startswith("decode") for h in hit):
                ax.axvline(ft, color=color, ls=":", lw=0.8)
    if window:
        ax.axvspan(0, window[0], color="grey", alpha=0.1)
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("decode up")
    ax2.grid(alpha=0.3)
    ax.set_ylabel("output tokens/s (thousands)")
    ax.set_title("Goodput under faults (dotted: a fault takes a decode instance; shaded: warm-up)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
