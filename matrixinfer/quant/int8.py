"""INT8 building blocks, pure functions: symmetric quantization of weights (per output
channel or per tensor) and of activations (per token or per tensor, dynamic), and the INT8
matrix product.

The product is a real int8 x int8 -> int32 GEMM (`torch._int_mm`: oneDNN with VNNI/AMX on
CPU, int8 tensor cores on CUDA); the per-token and per-channel scales multiply the int32
accumulator afterwards: y[t, o] = acc[t, o] * sx[t] * sw[o]. Nothing is dequantized before
the product.
"""

from __future__ import annotations

import torch

QMAX = 127  # symmetric int8: [-127, 127], so -x is representable whenever x is


def quantize_symmetric(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round x / scale to int8 (scale broadcasts against x); values past the range are clipped."""
    return torch.clamp(torch.round(x.float() / scale), -QMAX, QMAX).to(torch.int8)


def weight_scales(w: torch.Tensor, strategy: str = "channel", clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    """w [O, I] -> float32 scales [O, 1]: max|row| * clip / 127 per output channel ("channel"),
    or the tensor's max for every row ("tensor"). clip < 1 clips the largest weights (scale search)."""
    amax = w.detach().float().abs().amax(dim=1, keepdim=True)
    if strategy == "tensor":
        amax = amax.amax().expand_as(amax)
    elif strategy != "channel":
        raise ValueError(f"weight strategy {strategy!r}: channel or tensor")
    clip = torch.as_tensor(clip, dtype=torch.float32, device=w.device)
    return (amax * clip.reshape(-1, 1) if clip.dim() else amax * clip).clamp_min(1e-8) / QMAX


def quantize_weight(w: torch.Tensor, strategy: str = "channel", clip=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (int8 [O, I], float32 scales [O, 1]), round to nearest."""
    scale = weight_scales(w, strategy, clip)
    return quantize_symmetric(w, scale), scale


def quantize_activation(x: torch.Tensor, strategy: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]), dynamic: per row (token) or one
    scale for the whole tensor (the naive baseline)."""
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)
    if strategy == "tensor":
        amax = amax.amax().expand_as(amax)
    elif strategy != "token":
        raise ValueError(f"activation strategy {strategy!r}: token or tensor")
    scale = amax.clamp_min(1e-8) / QMAX
    return quantize_symmetric(x, scale), scale


def quantize_per_token_(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """quantize_activation(x, "token") written into existing tensors: x [M, K] float32 is
    overwritten (it is the work buffer), q_out [M, K] int8 and scale_out [M, 1] float32
    receive the values. For static buffers (expert-parallel dispatch): only [M, 1] is allocated."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)
    scale = amax.clamp_min_(1e-8).div_(QMAX)
    x.div_(scale).round_().clamp_(-QMAX, QMAX)
    q_out.copy_(x)
    scale_out.copy_(scale)


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 a [M, K] @ int8 b [K, N] -> int32 [M, N]. The CUDA kernel needs M > 16 and K, N
    multiples of 8: pad with zero rows/columns there (zeros add nothing to the sums)."""
    m, k = a.shape
    n = b.shape[1]
    if a.is_cuda:
        pm = max(17, -(-m // 8) * 8) - m
        pk, pn = -k % 8, -n % 8
        if pm or pk:
            a = torch.nn.functional.pad(a, (0, pk, 0, pm))
        if pk or pn:
            b = torch.nn.functional.pad(b, (0, pn, 0, pk))
        return torch._int_mm(a, b)[:m, :n]
    return torch._int_mm(a, b)


def int8_linear(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor, act_strategy: str = "token",
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] float, w_t [K, N] int8 (the weight transposed once at load), w_scale [1, N]
    float32 -> x W^T [..., N]: activations quantized dynamically, one int8 GEMM, scales after."""
    shape = x.shape
    xq, xs = quantize_activation(x.reshape(-1, shape[-1]), act_strategy)
    acc = int_mm(xq, w_t)
    y = (acc.float() * xs) * w_scale  # the epilogue: per-token x per-channel scale
    return y.to(out_dtype or x.dtype).reshape(*shape[:-1], w_t.shape[1])
