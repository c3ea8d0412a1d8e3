"""How a layer stores its weights and multiplies by them: the `quant_method` hook.

Every linear layer (linear.py) and the routed experts (experts.py) own no weights of their
own: at construction they ask their `QuantizationConfig` for a method, the method's
`create_weights` registers the parameters on the layer, and the layer's forward is the
method's `apply`. The layers only shard: each parameter says which of its dims holds output
features (`output_dim`) and input features (`input_dim`), and the layer's weight loader cuts
the checkpoint tensor along them. So a quantized method (INT8 W8A8: an int8 weight plus a
per-channel scale with `output_dim` 0, an int8 matmul in `apply`) is one new
`QuantizationConfig` subclass; attention and MoE code do not change.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.kernels import (AMX_BF16, AVX512, INTEL, bfloat16_linear, gemm_dtype, gemm_rows, grouped_mm,
                                 pack_small_mm, small_mm)

WeightLoader = Callable[..., None]


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    """Attach sharding metadata (output_dim, input_dim) and the weight_loader to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


class LinearMethodBase:
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        """Register this rank's parameters on `layer`. output_partition_sizes: this rank's
        share of each merged projection (one entry for an unmerged layer)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., sum(output_partition_sizes)]."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after the checkpoint is loaded (e.g. to quantize a bf16 checkpoint)."""

    def pack_small_mm(self, layer: nn.Module) -> None:
        """On the CPU, once the operators are loaded and the weights final (the runner calls it):
        keep the copy of the weights the few-rows operator reads (kernels.pack_small_mm), where
        it serves this method."""


# Up to how many rows a dense linear runs the few-rows operator (kernels.small_mm) instead of
# F.linear, per dtype. Measured per projection of the bundled and the 512 + 64 models, 2
# threads: float32 1.1-1.4x faster at one row with AVX-512, 1.3-2.5x at 1-8 rows with AVX2.
# bfloat16 without AMX (AMD EPYC Zen 4, AVX512-BF16; the operator's summed-tree reductions):
# the projections together 2.3-2.6x oneDNN's bfloat16 GEMM at 8 rows, 1.7-1.8x at 16, 1.2-1.4x
# at 32, level at 64; the engine's step at 32 sequences 5.2-5.6 -> 4.2-4.3 ms (35 operator calls
# a step instead of 15). With AMX, oneDNN's tiles take over from 9 rows as before.
# float32 on AMD EPYCs: MKL's GEMM (not tuned for them) stays slow past 8 rows, and the decode
# step doubled from 8 to 9 sequences (512 + 64 model, Zen 4: 4.3-4.7 -> 9.2-9.3 ms); small_mm up
# to 32 rows: 4.8-6.0 ms at 9, 10.0-11.1 vs 11.8-14.0 at 32; bundled model 2.05-2.30 vs 2.68-3.74
# at 32 (compiled steps, interleaved runs). MKL on Intel keeps 8 (it led there at few rows).
SMALL_MM_ROWS = {torch.bfloat16: 8 if AMX_BF16 else 32, torch.float32: 8 if INTEL else 32}
_MKL_LEADS = AVX512 and INTEL  # float32 few-row GEMMs: MKL ahead of small_mm (below)
# The dtypes for which it also runs inside a compiled step (bundled model, float32, median
# engine step at batch 1). float32 on an Intel Xeon with AVX-512 does not: there inductor's graph
# around MKL's GEMMs was faster (0.66 vs 0.72 ms). On AMD EPYCs the operator wins: 0.78-0.92 vs
# 0.91-1.62 ms (Zen 4, AVX-512; 2.30-2.40 vs 2.62-3.27 ms at batch 8) and 1.06-1.48 vs 1.75-1.92
# ms (Zen 3, AVX2).
SMALL_MM_COMPILED = {torch.bfloat16} if _MKL_LEADS else {torch.bfloat16, torch.float32}
# The logits projection (a linear with rows_repeat: one row per sequence, the count steady step
# after step) runs small_mm up to 32 rows and, past that, keeps bfloat16 as a compiled graph does
# (oneDNN reuses the shape's primitive; widening copied the whole weight to float32 every step).
# The bundled model's 256 x 4096 head at 32 rows, AMD EPYC Zen 4: bfloat16 small_mm 268 us,
# oneDNN 307, widened 0.94-2.0 ms; float32 small_mm 499 us, MKL 634 (at 64 rows 973 vs 1141, and
# bfloat16 oneDNN 471 vs small_mm 545). float32 on Intel with AVX-512 keeps SMALL_MM_ROWS, as MKL
# led there.
SMALL_MM_REPEATED_ROWS = {torch.bfloat16: 32, torch.float32: 8 if _MKL_LEADS else 32}


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype))
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)

    def pack_small_mm(self, layer):
        layer.weight_small_mm = pack_small_mm(layer.weight, pad_outputs=layer.batch_invariant)

    def apply(self, layer, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if layer.batch_invariant:  # every row count through the one operator (model/batch_invariant.py)
            y = small_mm(x.reshape(rows, x.shape[-1]), layer.weight_small_mm)
            return y[:, : layer.weight.shape[0]].reshape(*x.shape[:-1], -1)
        limit = (SMALL_MM_REPEATED_ROWS if layer.rows_repeat else SMALL_MM_ROWS).get(x.dtype, 0)
        packed = getattr(layer, "weight_small_mm", None)
        if (0 < rows <= limit and packed is not None and packed.dtype == x.dtype and packed.device == x.device
                and (x.dtype in SMALL_MM_COMPILED or not torch.compiler.is_compiling())):
            return small_mm(x.reshape(rows, x.shape[-1]), packed).view(*x.shape[:-1], -1)
        ct = gemm_dtype(x.dtype, x.device, rows, fixed_shape=layer.rows_repeat)
        if _pads_rows(ct, x.device) and not layer.rows_repeat:
            return bfloat16_linear(x, layer.weight)
        return F.linear(x.to(ct), layer.weight.to(ct)).to(x.dtype)


def _pads_rows(ct: torch.dtype, device: torch.device) -> bool:
    """A product multiplying in `ct` on `device` is an eager bfloat16 GEMM on the CPU, whose row
    count varies call to call (prefill chunks, mixed steps): kernels.bfloat16_linear pads it."""
    return ct == torch.bfloat16 and device.type == "cpu" and not torch.compiler.is_compiling()


class ExpertsMethodBase:
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register the stacked expert parameters w13_* ([E, 2I, H]: gate|up) and w2_*
        ([E, H, I]) on `layer`, I being this rank's share of the intermediate dimension."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, xs: torch.Tensor, local: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs [P, H]: one row per (token, expert) pair, grouped by expert; local [P]: the local
        expert of each row; counts [E]: rows per expert. Returns the SwiGLU outputs [P, H]."""
        raise NotImplementedError

    def apply_all(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """x [N, H] -> [E, N, H]: every local expert's SwiGLU output for every token, with no
        host sync (the dense path of small batches; None: this method has none)."""
        return None

    def apply_pairs(self, layer: nn.Module, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor | None:
        """x [N, H], local [N, k] (a local expert per pair, all valid) -> [N, k, H]: each pair's
        output from its expert's weights gathered per pair, with no host sync (None: no such path)."""
        return None

    def grouped_mm_serves(self, layer: nn.Module) -> bool:
        """apply_grouped_mm is available (the grouped matmul operator of matrixinfer/kernels)."""
        return False

    def apply_grouped_mm(self, layer: nn.Module, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """xs [P, H] grouped by expert, offs [E] int32 the end row of each expert's group ->
        the SwiGLU outputs [P, H], with no host sync."""
        raise NotImplementedError

    def small_mm_serves(self, layer: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
        """apply_small_mm is available for activations of `dtype` on `device` (the few-rows
        operator of matrixinfer/kernels, its packed weights kept by pack_small_mm)."""
        return False

    def pack_small_mm(self, layer: nn.Module) -> None:
        """As LinearMethodBase.pack_small_mm; called again when the experts' weights move (EPLB)."""

    def apply_small_mm(self, layer: nn.Module, xs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """xs [P, H], experts [P] each row's local expert -> the SwiGLU outputs [P, H]: for a few
        rows per expert, in any order (no sort, no host sync), each expert's weights read once."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


class UnquantizedExpertsMethod(ExpertsMethodBase):
    def grouped_mm_serves(self, layer):
        # the grouped matmul takes rows whose strides are multiples of 16 bytes
        size = layer.w13_weight.element_size()
        return all(d * size % 16 == 0 for d in (*layer.w13_weight.shape[1:], layer.w2_weight.shape[2]))

    def apply_grouped_mm(self, layer, xs, offs):
        w13, w2 = layer.w13_weight, layer.w2_weight
        ct = gemm_dtype(xs.dtype, xs.device, xs.shape[0] // w13.shape[0])  # rows per expert, on average
        if _pads_rows(ct, xs.device) and xs.shape[0]:
            # ATen's grouped matmul runs one GEMM per expert: pad each group to gemm_rows, so
            # that oneDNN meets few row counts instead of new ones at every prefill
            padded, place, offs = _pad_groups(xs, offs)
            return _grouped_swiglu(padded, w13, w2, offs)[place]
        return _grouped_swiglu(xs.to(ct), w13.to(ct), w2.to(ct), offs).to(xs.dtype)

    def pack_small_mm(self, layer):
        w13, w2 = pack_small_mm(layer.w13_weight), pack_small_mm(layer.w2_weight)
        layer.small_mm_weights = (w13, w2) if w13 is not None and w2 is not None else None

    def small_mm_serves(self, layer, dtype, device):
        packed = getattr(layer, "small_mm_weights", None)
        return packed is not None and packed[0].dtype == dtype and packed[0].device == device

    def apply_small_mm(self, layer, xs, experts):
        w13, w2 = layer.small_mm_weights
        gate, up = small_mm(xs, w13, experts).chunk(2, dim=-1)
        return small_mm(F.silu(gate) * up, w2, experts)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader):
        i, h = intermediate_size_per_partition, hidden_size
        w13 = nn.Parameter(torch.empty(num_experts, 2 * i, h, dtype=params_dtype))
        w2 = nn.Parameter(torch.empty(num_experts, h, i, dtype=params_dtype))
        set_weight_attrs(w13, output_dim=1, input_dim=2, weight_loader=weight_loader)
        set_weight_attrs(w2, output_dim=1, input_dim=2, weight_loader=weight_loader)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def apply_all(self, layer, x):
        ct = gemm_dtype(x.dtype, x.device)
        gate, up = torch.matmul(x.to(ct), layer.w13_weight.to(ct).transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        return torch.bmm(F.silu(gate) * up, layer.w2_weight.to(ct).transpose(1, 2)).to(x.dtype)

    def apply_pairs(self, layer, x, local):
        k, ct = local.shape[1], gemm_dtype(x.dtype, x.device)
        w13, w2 = layer.w13_weight[local.flatten()], layer.w2_weight[local.flatten()]  # [N*k, ...]
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [N*k, H, 1]
        gate, up = torch.bmm(w13.to(ct), xs.to(ct)).chunk(2, dim=1)
        return torch.bmm(w2.to(ct), F.silu(gate) * up).view(x.shape[0], k, -1).to(x.dtype)

    def apply(self, layer, xs, local, counts):
        """All experts at once: rows padded to [E, max count, H] and two batched matmuls.
        When padding would more than double the work (large, skewed batches) experts run one
        by one on their slices instead."""
        w13, w2 = layer.w13_weight, layer.w2_weight
        n_exp, max_count = counts.numel(), int(counts.max()) if xs.shape[0] else 0
        if n_exp * max_count > 2 * xs.shape[0]:
            ys = []
            for e, chunk in enumerate(xs.split(counts.tolist())):
                if chunk.numel():
                    ct = gemm_dtype(chunk.dtype, chunk.device, chunk.shape[0])
                    linear = bfloat16_linear if _pads_rows(ct, chunk.device) else F.linear
                    gate, up = linear(chunk.to(ct), w13[e].to(ct)).chunk(2, dim=-1)
                    ys.append(linear(F.silu(gate) * up, w2[e].to(ct)).to(xs.dtype))
            return torch.cat(ys) if ys else xs
        ct = gemm_dtype(xs.dtype, xs.device)
        offsets = torch.cumsum(counts, 0) - counts
        pos = torch.arange(xs.shape[0], device=xs.device) - offsets[local]
        rows = gemm_rows(max_count) if _pads_rows(ct, xs.device) else max_count
        padded = xs.new_zeros(n_exp, rows, xs.shape[-1])
        padded[local, pos] = xs
        gate, up = torch.bmm(padded.to(ct), w13.to(ct).transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, w2.to(ct).transpose(1, 2))
        return out[local, pos].to(xs.dtype)


def _pad_groups(xs: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows grouped by expert (offs: each group's end) -> the rows with every group followed by
    zero rows up to gemm_rows, each row's place among them, and the padded groups' ends. Reads
    offs on the host (eager calls only)."""
    ends = offs.tolist()
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    padded_ends = list(itertools.accumulate(gemm_rows(c) if c else 0 for c in counts))
    shift = [p - e for p, e in zip([0, *padded_ends[:-1]], [0, *ends[:-1]])]  # each group's start moves by
    place = torch.arange(xs.shape[0], device=xs.device) + torch.repeat_interleave(
        torch.tensor(shift, device=xs.device), torch.tensor(counts, device=xs.device))
    padded = xs.new_zeros(padded_ends[-1], xs.shape[1])
    padded[place] = xs
    return padded, place, torch.tensor(padded_ends, dtype=offs.dtype, device=offs.device)


def _grouped_swiglu(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    gate, up = grouped_mm(xs, w13.transpose(1, 2), offs).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs)


class QuantizationConfig:
    """Chooses each layer's method from its prefix (its parameter-name prefix in the model,
    e.g. "model.layers.3.self_attn.kv_b_proj"). This base class: unquantized everywhere."""

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        return UnquantizedLinearMethod()

    def get_experts_method(self, layer: nn.Module, prefix: str) -> ExpertsMethodBase:
        return UnquantizedExpertsMethod()


UNQUANTIZED = QuantizationConfig()
