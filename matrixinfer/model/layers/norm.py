"""RMSNorm, computed in float32 and scaled in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.kernels import small_mm


class RMSNorm(nn.Module):
    batch_invariant = False  # model/batch_invariant.py: the sum of squares through kernels.small_mm
    ones_small_mm = None  # ones [16, dim] packed for small_mm, where the mode is on (model_runner.prepare_small_mm)

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ones_small_mm is not None:
            return self.weight * self._invariant(x.float()).to(x.dtype)
        # normalize in float32, scale in the input dtype (as DeepSeek and transformers do)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) with each row's sum of squares one chain of additions in
        order (small_mm times ones): a compiled graph's reduction over the row otherwise picks
        its lanes and order by the graph's shapes (rows vectorised together in some, the row's
        own elements in others), so a row's norm changed with the step it ran in."""
        rows = x.reshape(-1, x.shape[-1])
        squares = small_mm(rows * rows, self.ones_small_mm)[:, :1]
        return (rows * torch.rsqrt(squares / x.shape[-1] + self.eps)).view(x.shape)
