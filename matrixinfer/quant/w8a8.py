"""W8A8 INT8 as a `quant_method` (model/layers/quantization.py): weights int8 per output
channel with a float32 scale (static, from the checkpoint), activations int8 per token
(dynamic, computed in the forward), products by the int8 GEMM of int8.py.

Which layers: every linear layer and the routed experts, except what the checkpoint's
`ignore` list names and what always stays high precision: the LM head (and the router gate,
which is not a linear layer here: moe.Router keeps it float32). Norms and embeddings are not
linear layers and are never touched.

kv_b_proj: the absorbed decode path (attention.py) folds `kv_b_proj.weight` into the query
and the output per head, which is a batched float product, not a linear layer. So
kv_b_proj keeps a float weight: our quantizer lists it in `ignore` (written in bf16), and a
checkpoint from elsewhere that quantized it is dequantized once at load (DequantizedLinear).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.model.layers.quantization import (
    ExpertsMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedExpertsMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from matrixinfer.model.weight_map import checkpoint_names
from matrixinfer.quant.int8 import int_mm, int8_linear, quantize_activation

ALWAYS_FLOAT = ("lm_head",)  # sensitive, and the head reads every token: stays high precision
ABSORBED = "kv_b_proj"  # read as a float weight by the absorbed decode path (see above)


def _make_scale(layer, rows: int, weight_loader, output_dim: int, leading: tuple[int, ...] = ()) -> nn.Parameter:
    """A float32 scale per output row; `owner` lets a per-tensor checkpoint scale find the
    layer's output sizes; keep_dtype keeps it float32 when the model is cast (loader.py)."""
    scale = nn.Parameter(torch.empty(*leading, rows, 1, dtype=torch.float32), requires_grad=False)
    set_weight_attrs(scale, output_dim=output_dim, weight_loader=weight_loader, owner=layer, keep_dtype=torch.float32)
    return scale


class W8A8LinearMethod(LinearMethodBase):
    def __init__(self, act_strategy: str = "token"):
        self.act_strategy = act_strategy

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.int8), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", _make_scale(layer, rows, _scale_loader(weight_loader), 0))

    def apply(self, layer, x):
        # weight [O, I] int8: its transpose is a view, which the int8 GEMM reads as it is
        return int8_linear(x, layer.weight.t(), layer.weight_scale.t(), self.act_strategy)


class DequantizedLinearMethod(W8A8LinearMethod):
    """An int8 checkpoint tensor for a layer that must stay float (kv_b_proj): loaded as int8,
    then replaced once by weight * scale in the model dtype."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)
        self.dtype = params_dtype

    def process_weights_after_loading(self, layer):
        w = (layer.weight.float() * layer.weight_scale).to(self.dtype)
        del layer.weight_scale
        layer.weight = nn.Parameter(w, requires_grad=False)

    def apply(self, layer, x):
        return F.linear(x, layer.weight)


def _scale_loader(weight_loader):
    """A per-tensor scale ([1] or []) from the checkpoint becomes one value per output row."""
    def load(param, loaded, shard_id=None):
        if loaded.numel() == 1:
            rows = param.shape[param.output_dim] if shard_id is None else None
            loaded = loaded.reshape(1, 1).expand(_full_rows(param, shard_id, rows), 1)
        weight_loader(param, loaded.reshape(-1, 1).float(), shard_id)
    return load


def _full_rows(param, shard_id, rows):
    layer = param.owner
    if isinstance(shard_id, tuple):  # experts: (expert, piece)
        full = param.shape[param.output_dim]
        return full if shard_id[1] == "down_proj" else full // 2 * layer.tp_size
    sizes = layer.output_sizes
    return sizes[shard_id] if shard_id is not None else sum(sizes)


class W8A8ExpertsMethod(ExpertsMethodBase):
    """The routed experts in INT8: every (token, expert) row is quantized per token once, then
    one int8 GEMM per expert that has rows (gate|up), SwiGLU in float, the intermediate
    quantized per token, one int8 GEMM per expert (down)."""

    def __init__(self, act_strategy: str = "token"):
        self.act_strategy = act_strategy

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       weight_loader):
        i, h = intermediate_size_per_partition, hidden_size
        w13 = nn.Parameter(torch.empty(num_experts, 2 * i, h, dtype=torch.int8), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, h, i, dtype=torch.int8), requires_grad=False)
        set_weight_attrs(w13, output_dim=1, input_dim=2, weight_loader=weight_loader)
        set_weight_attrs(w2, output_dim=1, input_dim=2, weight_loader=weight_loader)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        for name, rows in (("w13_weight_scale", 2 * i), ("w2_weight_scale", h)):
            scale = _make_scale(layer, rows, _scale_loader(weight_loader), 1, leading=(num_experts,))
            layer.register_parameter(name, scale)

    def apply_all(self, layer, x):
        xq, sx = quantize_activation(x, self.act_strategy)  # once for all experts
        return torch.stack([self._expert(layer, e, xq, sx, x.dtype) for e in range(layer.w13_weight.shape[0])])

    def _expert(self, layer, e: int, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        acc = int_mm(xq, layer.w13_weight[e].t())
        gate, up = (acc.float() * sx * layer.w13_weight_scale[e].t()).chunk(2, dim=-1)
        hq, sh = quantize_activation(F.silu(gate) * up, self.act_strategy)
        acc = int_mm(hq, layer.w2_weight[e].t())
        return (acc.float() * sh * layer.w2_weight_scale[e].t()).to(dtype)

    def apply_pairs(self, layer, x, local):
        """Each (token, expert) pair times its expert's int8 weights gathered per pair: the
        small-batch path with no host sync (what the compiled decode step needs; the grouped
        path reads the counts on the host). The int8 products are summed in float32, exactly
        the int32 sums of int_mm while they stay below 2**24 (inner sizes under 1,040 at full
        scale |q| = 127), and within float32 rounding of them past that."""
        k, rows = local.shape[1], local.flatten()
        xq, sx = quantize_activation(x, self.act_strategy)
        xq, sx = xq.repeat_interleave(k, dim=0), sx.repeat_interleave(k, dim=0)  # [N*k, H], [N*k, 1]
        acc = torch.bmm(layer.w13_weight[rows].float(), xq.float()[:, :, None]).squeeze(-1)  # [N*k, 2I]
        gate, up = (acc * sx * layer.w13_weight_scale[rows].squeeze(-1)).chunk(2, dim=-1)
        hq, sh = quantize_activation(F.silu(gate) * up, self.act_strategy)
        acc = torch.bmm(layer.w2_weight[rows].float(), hq.float()[:, :, None]).squeeze(-1)  # [N*k, H]
        return (acc * sh * layer.w2_weight_scale[rows].squeeze(-1)).view(x.shape[0], k, -1).to(x.dtype)

    def apply(self, layer, xs, local, counts):
        dtype = xs.dtype
        xq, sx = quantize_activation(xs, self.act_strategy)
        out = xs.new_empty(xs.shape)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                out[rows] = self._expert(layer, e, xq[rows], sx[rows], dtype)
            start += n
        return out


class W8A8Config(QuantizationConfig):
    """The INT8 method for every quantizable layer not in `ignore`. ignore: module names as
    the checkpoint spells them ("lm_head", "model.layers.0.self_attn.kv_b_proj"), or regular
    expressions prefixed "re:", as compressed-tensors writes them."""

    def __init__(self, ignore: list[str] | None = None, num_hidden_layers: int = 0, act_strategy: str = "token"):
        self.ignore = list(ignore or [])
        self.num_hidden_layers = num_hidden_layers  # to name MTP layers as the checkpoint does
        self.act_strategy = act_strategy

    def is_ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:") and re.match(pattern[3:], name) or pattern == name:
                return True
        return False

    def checkpoint_names(self, prefix: str) -> list[str]:
        return checkpoint_names(prefix, self.num_hidden_layers)

    def _float(self, prefix: str) -> bool:
        names = self.checkpoint_names(prefix)
        ignored = [self.is_ignored(n) for n in names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"{prefix}: the checkpoint quantizes only some of {names}; they share one int8 weight")
        return all(ignored) or prefix in ALWAYS_FLOAT

    def get_linear_method(self, layer, prefix):
        if self._float(prefix):
            return UnquantizedLinearMethod()
        if prefix.endswith(ABSORBED):
            return DequantizedLinearMethod()
        return W8A8LinearMethod(self.act_strategy)

    def get_experts_method(self, layer, prefix):
        return UnquantizedExpertsMethod() if self._float(prefix) else W8A8ExpertsMethod(self.act_strategy)
