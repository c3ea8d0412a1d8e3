"""Linear layers that shard over the tensor-parallel group and load their shard.

With T ranks (parallel/state.py), a layer of input size I and output size O holds:

- `ReplicatedLinear`: the whole [O, I] weight on every rank (the MLA latent down-projections,
  the MTP eh_proj, the LM head: small, or read by every rank anyway);
- `ColumnParallelLinear`: output rows [r*O/T, (r+1)*O/T) of rank r: its output is this rank's
  slice of the features (q_b_proj / q_proj and kv_b_proj: this rank's attention heads;
  gate|up: this rank's slice of the MLP intermediate dimension). No communication;
- `RowParallelLinear`: input columns [r*I/T, (r+1)*I/T): it reads the slice a column-parallel
  layer produced and returns a partial sum; `reduce_results=True` adds the partials over the
  group (o_proj: the one all-reduce of an attention block; the dense MLP's down_proj: the one
  of an MLP block). The MoE turns it off for the shared experts' down_proj and reduces routed
  + shared partials once (moe.py);
- `MergedColumnParallelLinear` / `MergedReplicatedLinear`: several projections of the same
  input stacked into one weight so one matmul reads x (gate|up; q_a|kv_a). Each piece is
  sharded on its own, so rank r holds [gate_r; up_r], and each piece loads from its own
  checkpoint tensor with `shard_id` = its index.

Every parameter has `weight_loader(param, loaded_weight, shard_id=None)`: it takes the full
checkpoint tensor, checks its shape, narrows it to this rank's part and copies that. The
weights themselves come from the layer's `quant_method` (quantization.py). No biases:
DeepSeek has none.
"""

from __future__ import annotations

import torch
from torch import nn

from matrixinfer.model.layers.quantization import UNQUANTIZED, QuantizationConfig
from matrixinfer.parallel.state import get_tp_rank, get_tp_size, tp_all_reduce


def copy_shard(target: torch.Tensor, loaded_weight: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> None:
    """Copy rank `tp_rank`'s slice along `dim` of the full checkpoint tensor into `target`
    (dim None: the whole tensor), after checking that the full shape is what the model expects."""
    full = list(target.shape)
    if dim is not None:
        full[dim] *= tp_size
    if tuple(loaded_weight.shape) != tuple(full):
        raise ValueError(f"checkpoint shape {tuple(loaded_weight.shape)} != model shape {tuple(full)}")
    if dim is not None:  # narrow first: only this rank's part is copied
        loaded_weight = loaded_weight.narrow(dim, tp_rank * target.shape[dim], target.shape[dim])
    with torch.no_grad():
        target.copy_(loaded_weight)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Whole-tensor copy, for replicated parameters without a loader of their own (norms, router)."""
    copy_shard(param.data, loaded_weight, None, 0, 1)


class LinearBase(nn.Module):
    """y = x W^T with W built by the quant method. `split` names the dimension sharded over
    the tensor-parallel group: "output", "input" or None (replicated)."""

    split: str | None = None
    batch_invariant = False  # model/batch_invariant.py

    def __init__(self, input_size: int, output_sizes: list[int], quant_config: QuantizationConfig | None = None,
                 prefix: str = "", params_dtype: torch.dtype | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None, rows_repeat: bool = False):
        super().__init__()
        # rows_repeat: called with one row per sequence of a step (the logits), so the same row
        # count step after step, which the linear methods may treat as a fixed shape
        self.rows_repeat = rows_repeat
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        if self.split is None:
            self.tp_rank, self.tp_size = 0, 1  # replicated: every rank holds everything
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(self.output_sizes)
        shard_out, shard_in = self.split == "output", self.split == "input"
        for size in (self.output_sizes if shard_out else [input_size] if shard_in else []):
            if size % self.tp_size:
                name = prefix or type(self).__name__
                raise ValueError(f"{name}: size {size} not divisible by tp size {self.tp_size}")
        self.output_partition_sizes = [s // self.tp_size if shard_out else s for s in self.output_sizes]
        self.input_size_per_partition = input_size // self.tp_size if shard_in else input_size
        self.quant_method = (quant_config or UNQUANTIZED).get_linear_method(self, prefix)
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_partition_sizes,
                                         params_dtype or torch.get_default_dtype(), self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's part of a full checkpoint tensor into `param` (for a merged layer,
        into the rows of projection `shard_id`)."""
        target = param.data
        out_dim = getattr(param, "output_dim", None)
        if shard_id is not None:
            if out_dim is None:
                raise ValueError(f"{type(self).__name__}: parameter without output_dim cannot take shard {shard_id}")
            offset = sum(self.output_partition_sizes[:shard_id])
            target = target.narrow(out_dim, offset, self.output_partition_sizes[shard_id])
        elif len(self.output_sizes) > 1 and out_dim is not None:
            raise ValueError(f"{type(self).__name__} merges {len(self.output_sizes)} projections: give a shard_id")
        dim = {"output": out_dim, "input": getattr(param, "input_dim", None)}.get(self.split)
        copy_shard(target, loaded_weight, dim, self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, tp={self.tp_rank}/{self.tp_size}"


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, **kw):
        super().__init__(input_size, [output_size], **kw)


class MergedReplicatedLinear(LinearBase):
    """Replicated projections of one input, one matmul: the output is their concatenation."""

    def __init__(self, input_size: int, output_sizes: list[int], **kw):
        super().__init__(input_size, output_sizes, **kw)


class ColumnParallelLinear(LinearBase):
    split = "output"

    def __init__(self, input_size: int, output_size: int, **kw):
        super().__init__(input_size, [output_size], **kw)


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel projections of one input, one matmul: the output is the concatenation
    of this rank's slice of each."""

    split = "output"

    def __init__(self, input_size: int, output_sizes: list[int], **kw):
        super().__init__(input_size, output_sizes, **kw)


class RowParallelLinear(LinearBase):
    split = "input"

    def __init__(self, input_size: int, output_size: int, reduce_results: bool = True, **kw):
        super().__init__(input_size, [output_size], **kw)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        return tp_all_reduce(y) if self.reduce_results else y
