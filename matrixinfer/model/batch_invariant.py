"""Batch-invariant mode (EngineConfig.batch_invariant): a token's logits are bitwise the same
whatever the step it runs in: alone or among other requests, in a prompt's chunk or a decode
step, after a prefix-cache hit, a preemption's recompute, or a hand-over to another instance.

Why they are not by default (measured, docs/determinism.md): the products pick their kernel
by row count (MKL's GEMV at one row and its GEMM from a few rows sum in different orders; the
few-rows operator serves up to 32), the MoE picks its path by pairs per expert, and attention
by step kind (a prompt attends with SDPA over up-projected keys in blocks sized by its
length, a decode row with the absorbed kernel over the cached latents).

In this mode:
- every dense product (the linears, the router, the LM head, the absorbed MLA products) and
  the routed experts run kernels.small_mm, whose each output is one chain of multiply-adds
  over K in order, whatever rows are beside it (outputs padded to its 16-wide blocks);
  W8A8 products are int8 x int8 sums in int32, exact in any order, and their experts'
  weighted sums are taken one way on every path;
- every token attends through the paged decode kernel (kernels.paged_mla_decode: one query
  row over its sequence's cached latents, the blocks in order, the online softmax rescaled
  at block ends), so a prompt's token computes what a decode row computes;
- the runner makes every step a decode step over tokens (ModelRunner.prepare), one graph
  (compiled or eager) for prompts, chunks and decode rows alike.
The layers read `batch_invariant`, set on the modules of one model by `enable`, so two
engines of one process can run different modes.
"""

from __future__ import annotations

import torch
from torch import nn


def enable(model: nn.Module) -> None:
    """Turn the mode on for every module of `model` that has one (a class attribute
    `batch_invariant`); call it before the few-rows operator's weights are packed."""
    for module in model.modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = True


def sum_in_order(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """t summed over `dim` (a few terms: the top-k) one term after another, an order no compiled
    graph's shapes can change (a compiled reduction picks its own)."""
    out = t.select(dim, 0)
    for j in range(1, t.shape[dim]):
        out = out + t.select(dim, j)
    return out.unsqueeze(dim) if keepdim else out
