"""DeepSeek-V3's FP8 release format as a `quant_method` (model/layers/quantization.py).

config.json carries

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and each quantized projection `<module>.weight` is float8_e4m3fn [O, I] beside
`<module>.weight_scale_inv` float32 [ceil(O / 128), ceil(I / 128)]: weight = fp8 * scale of its
128 x 128 block (the edge blocks are ragged where O or I is not a multiple of 128). Which modules
are quantized is read from the checkpoint's tensors (those with a `weight_scale_inv`); the release
keeps the embeddings, the LM head, the norms and the router gate in bf16.

Two ways to run it (the loader picks, loader.load_model's keep_fp8):
- kept (dtype "auto", or quantization="fp8"): the weights stay 1 byte in memory with their block
  scales, dequantized block by block inside each product (kernels.fp8_block_mm); activations in
  the model dtype. kv_b_proj is read as a float weight by the absorbed decode path (see w8a8.py),
  so it alone is dequantized once at load (Fp8DequantizedLinearMethod).
- dequantized (an explicit dtype): every layer unquantized in that dtype; the loader dequantizes
  each checkpoint tensor on its own as it copies it (dequantize_tensor), so no second copy of the
  model exists at any time.

Under tensor parallelism a shard need not start on a block edge (and merged projections, q_a |
kv_a and gate | up, put a piece's blocks after another's ragged last block), so each layer keeps
the scale rows of the blocks its rows touch and an explicit row -> scale-row map (`fp8_row_block`),
plus the column grid's offset (`fp8_k_shift`) for input-split shards.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.kernels import cpu_ops_serve, fp8_block_dequant, fp8_block_mm
from matrixinfer.model.layers.quantization import (
    ExpertsMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedExpertsMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from matrixinfer.model.weight_map import checkpoint_names
from matrixinfer.quant.w8a8 import ABSORBED

QUANT_METHOD = "fp8"
SCALE_SUFFIX = ".weight_scale_inv"
FP8 = torch.float8_e4m3fn
# the checkpoint tensors DeepSeek's release stores in FP8: every projection but the LM head and
# the router gate (writers of the format use it: bench/make_model.py, the tests' fixtures)
RELEASE_FP8 = re.compile(r".*\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|"
                         r"down_proj|eh_proj)\.weight$")


def is_fp8_dtype(name: str) -> bool:
    """A safetensors ("F8_E4M3") or torch ("torch.float8_e4m3fn") dtype name of an FP8 tensor."""
    name = name.lower()
    return "f8_" in name or "float8" in name


def _blocks(start: int, size: int, block: int) -> tuple[int, int]:
    """The blocks [first, first + count) of a grid of `block` that rows [start, start + size) touch."""
    if size <= 0:
        return start // block, 0
    return start // block, (start + size - 1) // block - start // block + 1


def _row_map(starts: list[int], sizes: list[int], block: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Pieces of rows (global start, size each, stacked) -> each local row's scale row (the
    pieces' touched blocks stacked in order), and each piece's first block and block count."""
    parts, firsts, counts, offset = [], [], [], 0
    for start, size in zip(starts, sizes):
        first, count = _blocks(start, size, block)
        rows = torch.arange(start, start + size, device="cpu")
        parts.append(rows // block - first + offset)
        firsts.append(first)
        counts.append(count)
        offset += count
    return torch.cat(parts).to(torch.int32), firsts, counts


def _fp8_param(*shape: int) -> nn.Parameter:
    w = nn.Parameter(torch.empty(*shape, dtype=FP8), requires_grad=False)
    w.keep_dtype = FP8  # the loader casts the model to its dtype: this stays float8
    return w


def _scale_param(*shape: int, **attrs) -> nn.Parameter:
    scale = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    set_weight_attrs(scale, keep_dtype=torch.float32, **attrs)
    return scale


def _check_grid(loaded: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> None:
    want = (_blocks(0, rows, block[0])[1], _blocks(0, cols, block[1])[1])
    if tuple(loaded.shape) != want:
        raise ValueError(f"block scale shape {tuple(loaded.shape)} != {want} for a [{rows}, {cols}] weight in "
                         f"{block[0]} x {block[1]} blocks")


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        bn, bk = self.block
        weight = _fp8_param(sum(output_partition_sizes), input_size_per_partition)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        out_split, in_split = layer.split == "output", layer.split == "input"
        starts = [layer.tp_rank * n if out_split else 0 for n in output_partition_sizes]
        row_block, firsts, counts = _row_map(starts, output_partition_sizes, bn)
        k_start = layer.tp_rank * input_size_per_partition if in_split else 0
        k_first, k_count = _blocks(k_start, input_size_per_partition, bk)
        layer.fp8_row_block, layer.fp8_k_shift = row_block, k_start % bk

        def load_scale(param, loaded, shard_id=None):
            if shard_id is None and len(counts) > 1:
                raise ValueError(f"{type(layer).__name__} merges {len(counts)} projections: give a shard_id")
            piece = shard_id or 0
            _check_grid(loaded, layer.output_sizes[piece], layer.input_size, self.block)
            part = loaded[firsts[piece]:firsts[piece] + counts[piece], k_first:k_first + k_count]
            with torch.no_grad():
                param.data[sum(counts[:piece]):sum(counts[:piece + 1])].copy_(part)

        # output_split: the scale rows of each merged piece (weight_map.checkpoint_tensors splits by it)
        layer.register_parameter("weight_scale_inv", _scale_param(sum(counts), k_count, output_dim=0,
                                                                  output_split=counts, weight_loader=load_scale))

    def apply(self, layer, x):
        rows = x.reshape(-1, x.shape[-1])
        y = fp8_block_mm(rows, layer.weight, layer.weight_scale_inv, _on(layer.fp8_row_block, x.device),
                         layer.fp8_k_shift, self.block[1])
        return y.view(*x.shape[:-1], y.shape[-1])


class Fp8DequantizedLinearMethod(Fp8LinearMethod):
    """An FP8 checkpoint tensor for a layer that must stay float (kv_b_proj): loaded as FP8,
    then replaced once by its dequantized weight in the model dtype."""

    apply = UnquantizedLinearMethod.apply
    pack_small_mm = UnquantizedLinearMethod.pack_small_mm

    def __init__(self, block: tuple[int, int], dtype: torch.dtype):
        super().__init__(block)
        self.dtype = dtype

    def process_weights_after_loading(self, layer):
        w = fp8_block_dequant(layer.weight, layer.weight_scale_inv, layer.fp8_row_block, layer.fp8_k_shift,
                              self.block[1], self.dtype)
        del layer.weight_scale_inv
        layer.weight = nn.Parameter(w, requires_grad=False)


class Fp8ExpertsMethod(ExpertsMethodBase):
    """The routed experts in FP8: gate|up and down of every expert as one fp8_block_mm each, the
    rows bucketed by expert inside the operator (every path: few or many pairs, compiled or not)."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader):
        (bn, bk), i, h = self.block, intermediate_size_per_partition, hidden_size
        w13, w2 = _fp8_param(num_experts, 2 * i, h), _fp8_param(num_experts, h, i)
        set_weight_attrs(w13, output_dim=1, input_dim=2, weight_loader=weight_loader)
        set_weight_attrs(w2, output_dim=1, input_dim=2, weight_loader=weight_loader)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        start = layer.tp_rank * i  # this rank's rows of gate and of up, its columns of down
        layer.fp8_w13_row_block, (first, _), (count, _) = _row_map([start, start], [i, i], bn)
        layer.fp8_w2_row_block = _row_map([0], [h], bn)[0]
        k_first, k_count = _blocks(start, i, bk)
        layer.fp8_w2_k_shift = start % bk
        h_blocks = _blocks(0, h, bk)[1]

        def load_scale(param, loaded, shard_id):
            expert, piece = shard_id
            slot = int(layer.local_index[expert]) if 0 <= expert < layer.num_experts else -1
            if slot < 0:
                raise ValueError(f"expert {expert} is not held by this process (holds {layer.expert_ids})")
            with torch.no_grad():
                if piece == "down_proj":
                    _check_grid(loaded, h, i * layer.tp_size, self.block)
                    param.data[slot].copy_(loaded[:, k_first:k_first + k_count])
                else:
                    _check_grid(loaded, i * layer.tp_size, h, self.block)
                    at = count * ("gate_proj", "up_proj").index(piece)
                    param.data[slot, at:at + count].copy_(loaded[first:first + count])

        layer.register_parameter("w13_weight_scale_inv", _scale_param(num_experts, 2 * count, h_blocks, output_dim=1,
                                                                      weight_loader=load_scale))
        layer.register_parameter("w2_weight_scale_inv", _scale_param(num_experts, _blocks(0, h, bn)[1], k_count,
                                                                     output_dim=1, weight_loader=load_scale))

    def _swiglu(self, layer, xs, w13, s13, w2, s2, experts):
        d, bk = xs.device, self.block[1]
        gate, up = fp8_block_mm(xs, w13, s13, _on(layer.fp8_w13_row_block, d), 0, bk, experts).chunk(2, dim=-1)
        return fp8_block_mm(F.silu(gate) * up, w2, s2, _on(layer.fp8_w2_row_block, d), layer.fp8_w2_k_shift, bk,
                            experts)

    def small_mm_serves(self, layer, dtype, device):
        return dtype in (torch.float32, torch.bfloat16) and cpu_ops_serve(device)

    def apply_small_mm(self, layer, xs, experts):
        return self._swiglu(layer, xs, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                            layer.w2_weight_scale_inv, experts)

    def apply(self, layer, xs, local, counts):
        return self.apply_small_mm(layer, xs, local)

    def apply_pairs(self, layer, x, local):
        k = local.shape[1]
        return self.apply_small_mm(layer, x.repeat_interleave(k, dim=0), local.flatten()).view(x.shape[0], k, -1)

    def apply_all(self, layer, x):
        return torch.stack([self._swiglu(layer, x, layer.w13_weight[e], layer.w13_weight_scale_inv[e],
                                         layer.w2_weight[e], layer.w2_weight_scale_inv[e], None)
                            for e in range(layer.w13_weight.shape[0])])


class Fp8Config(QuantizationConfig):
    """The FP8 block method for every module the checkpoint stores in FP8 (`fp8_modules`: the
    checkpoint's module names that have a weight_scale_inv); dequantize: run every layer
    unquantized instead (the loader dequantizes each tensor as it copies it). dtype: the model's,
    which kv_b_proj is dequantized to."""

    def __init__(self, fp8_modules: set[str], block: tuple[int, int] = (128, 128), num_hidden_layers: int = 0,
                 dequantize: bool = False, dtype: torch.dtype = torch.bfloat16):
        self.fp8_modules, self.block = set(fp8_modules), tuple(block)
        self.num_hidden_layers, self.dequantize, self.dtype = num_hidden_layers, dequantize, dtype

    def _fp8(self, prefix: str) -> bool:
        names = checkpoint_names(prefix, self.num_hidden_layers)
        stored = [n in self.fp8_modules for n in names]
        if any(stored) and not all(stored):
            raise ValueError(f"{prefix}: the checkpoint stores only some of {names} in FP8; they share one weight")
        return all(stored) and not self.dequantize

    def get_linear_method(self, layer, prefix):
        if not self._fp8(prefix):
            return UnquantizedLinearMethod()
        if prefix.endswith(ABSORBED):
            return Fp8DequantizedLinearMethod(self.block, self.dtype)
        return Fp8LinearMethod(self.block)

    def get_experts_method(self, layer, prefix):
        return Fp8ExpertsMethod(self.block) if self._fp8(prefix) else UnquantizedExpertsMethod()


def config_from_dict(qcfg: dict, keys, num_hidden_layers: int = 0, dequantize: bool = False,
                     dtype: torch.dtype = torch.bfloat16) -> Fp8Config:
    """config.json's quantization_config (quant_method fp8) and the checkpoint's tensor names ->
    the FP8 method, or a clear error for a variant this engine does not run."""
    if qcfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 fmt {qcfg.get('fmt')!r}: only e4m3 (float8_e4m3fn) is supported")
    if qcfg.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 activation_scheme {qcfg.get('activation_scheme')!r}: only dynamic is supported")
    block = qcfg.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"fp8 weight_block_size {block!r}: block-wise scales [rows, cols] are needed (per-tensor "
                         "FP8 is not supported)")
    modules = {k[:-len(SCALE_SUFFIX)] for k in keys if k.endswith(SCALE_SUFFIX)}
    return Fp8Config(modules, (int(block[0]), int(block[1])), num_hidden_layers, dequantize, dtype)


def dequantize_tensor(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype):
    """One checkpoint tensor [O, I] float8 with its [ceil(O/bn), ceil(I/bk)] block scales -> dtype."""
    _check_grid(scale_inv, w.shape[0], w.shape[1], block)
    rows = (torch.arange(w.shape[0], device=w.device) // block[0]).to(torch.int32)
    return fp8_block_dequant(w, scale_inv, rows, 0, block[1], dtype)


def quantize_tensor(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [O, I] -> (float8_e4m3fn [O, I], float32 weight_scale_inv [ceil(O/bn), ceil(I/bk)]) as
    DeepSeek's release quantizes: each block's max |w| maps to e4m3's largest value, 448."""
    bn, bk = block
    o, i = w.shape
    rb, kb = _blocks(0, o, bn)[1], _blocks(0, i, bk)[1]
    padded = F.pad(w.float(), (0, kb * bk - i, 0, rb * bn - o)).view(rb, bn, kb, bk)
    amax = padded.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [rb, kb]
    scale = amax / torch.finfo(FP8).max
    q = (padded / scale[:, None, :, None]).view(rb * bn, kb * bk)[:o, :i].to(FP8)
    return q, scale
