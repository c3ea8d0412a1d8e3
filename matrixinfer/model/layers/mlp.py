"""The SwiGLU feed-forward of the dense layers and the shared experts, tensor-parallel over
its intermediate dimension: gate|up merged column-parallel, down row-parallel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from matrixinfer.model.layers.quantization import QuantizationConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        # reduce_results=False: the caller adds this partial sum to others before one all-reduce
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
