"""Calibration statistics: run the float model on calibration text and record, for the input
of every quantizable projection (and of every routed expert's gate|up and down), the
per-channel max |x|, the Hessian X^T X and a strided sample of rows for the searches.

Statistics come from one pass of the float model (not layer by layer through already
quantized layers): simpler, and at INT8 the drift a quantized prefix adds is small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from matrixinfer.model.layers import LinearBase, RoutedExperts
from matrixinfer.model.layers.quantization import UnquantizedExpertsMethod
from matrixinfer.model.moe import Router


@dataclass
class InputStats:
    """Statistics of the inputs one weight reads."""
    act_max: torch.Tensor | None = None  # [I]
    hessian: torch.Tensor | None = None  # [I, I], sum of x x^T
    rows: list[torch.Tensor] = field(default_factory=list)
    count: int = 0
    max_rows: int = 512

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        amax = x.abs().amax(0)
        self.act_max = amax if self.act_max is None else torch.maximum(self.act_max, amax)
        h = x.t() @ x
        self.hessian = h if self.hessian is None else self.hessian + h
        self.count += x.shape[0]
        kept = sum(r.shape[0] for r in self.rows)
        if kept < self.max_rows:  # every 4th row of the early batches: spread over positions
            self.rows.append(x[::4][: self.max_rows - kept].clone())

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.zeros(0, 0)

    def scaled(self, s: torch.Tensor) -> None:
        """The statistics of x / s (after smoothing by s)."""
        self.act_max = self.act_max / s
        self.hessian = self.hessian / s[:, None] / s[None, :]
        self.rows = [r / s for r in self.rows]


class _RecordingExperts(UnquantizedExpertsMethod):
    """The float experts one by one, recording each expert's gate|up and down inputs."""

    def __init__(self, stats: dict):
        self.stats = stats

    def apply(self, layer, xs, local, counts):
        out = xs.new_empty(xs.shape)
        start = 0
        for e, n in enumerate(counts.tolist()):
            rows = slice(start, start + n)
            if n:
                self.stats[("w13", e)].add(xs[rows])
                gate, up = F.linear(xs[rows], layer.w13_weight[e]).chunk(2, dim=-1)
                h = F.silu(gate) * up
                self.stats[("w2", e)].add(h)
                out[rows] = F.linear(h, layer.w2_weight[e])
            start += n
        return out


@torch.no_grad()
def collect_stats(model, batches, max_rows: int = 512, progress=None, forward=None) -> dict:
    """batches: an iterable of token-id tensors [B, T]. Returns {linear module name: InputStats}
    and, for routed experts, {(experts module name, "w13" | "w2", expert): InputStats}.
    forward(batch): what runs a batch (default: the whole model on token ids; the streaming
    quantizer runs one layer on hidden states)."""
    stats: dict = {}
    hooks, swapped = [], []
    for name, module in model.named_modules():
        if isinstance(module, (LinearBase, Router)):  # the router's input: the whole MoE's, for smoothing
            stats[name] = InputStats(max_rows=max_rows)
            hooks.append(module.register_forward_pre_hook(lambda m, args, s=stats[name]: s.add(args[0])))
        elif isinstance(module, RoutedExperts):
            per_expert = {(kind, e): InputStats(max_rows=max_rows)
                          for kind in ("w13", "w2") for e in range(len(module.expert_ids))}
            stats.update({(name, kind, e): s for (kind, e), s in per_expert.items()})
            swapped.append((module, module.quant_method))
            module.quant_method = _RecordingExperts(per_expert)
    try:
        for batch in batches:
            if forward is None:
                model(batch, torch.arange(batch.shape[1]).expand_as(batch))
            else:
                forward(batch)
            if progress is not None:
                progress.update(1)
    finally:
        for h in hooks:
            h.remove()
        for module, method in swapped:
            module.quant_method = method
    return stats
