"""Small building blocks: RMSNorm, the SwiGLU MLP and rotary embeddings (with YaRN)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.config import RopeConfig, yarn_get_mscale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32, scale in the input dtype (as DeepSeek and transformers do)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def pack_rows(linears: list[nn.Linear], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the weights of linears that read the same input into one matrix (one
    matmul instead of several) and make each linear's weight a view into it, so parameter
    names, state_dict and memory stay as they were."""
    weights = [lin.weight.data for lin in linears]
    packed = torch.cat(weights) if out is None else torch.cat(weights, out=out)
    start = 0
    for lin, w in zip(linears, weights):
        lin.weight.data = packed[start:start + w.shape[0]]
        start += w.shape[0]
    return packed


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers, each routed expert and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # set by pack() for inference

    def pack(self, out: torch.Tensor | None = None) -> None:
        self.gate_up = pack_rows([self.gate_proj, self.up_proj], out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_inv_freq(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor), as in DeepSeek-V3."""
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if cfg.type != "yarn":
        return 1.0 / pos_freqs, 1.0
    factor, orig = cfg.factor, cfg.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # high-frequency dims keep their original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if cfg.mscale and cfg.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, cfg.mscale) / yarn_get_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RopeConfig, dim: int):
        super().__init__()
        self.cfg, self.dim = cfg, dim
        inv_freq, self.attention_factor = rope_inv_freq(cfg, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = cfg.interleave

    def reset_parameters(self) -> None:
        self.inv_freq = rope_inv_freq(self.cfg, self.dim)[0].to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, dim]; cos/sin: [..., dim/2] broadcast over heads."""
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if self.interleave:
            # DeepSeek's rope dims are interleaved pairs; the rotated output is laid out
            # de-interleaved (evens then odds). Queries and keys share the layout, so q.k is unchanged.
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
