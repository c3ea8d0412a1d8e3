"""Process groups for model parallelism, and the two collectives the model uses.

The executor starts one OS process per rank and calls `torch.distributed.init_process_group`
(gloo on CPU, NCCL on CUDA), then `init_model_parallel(tensor_parallel_size)`. Ranks
[k*tp, (k+1)*tp) form tensor-parallel group k; the model's layers read their rank and size
in that group when they are built and shard their weights accordingly (model/layers/linear.py):

- column-parallel layers (q_b_proj / q_proj, kv_b_proj, gate|up) split their output features,
  so each rank computes its own attention heads or slice of the MLP intermediate dimension;
- row-parallel layers (o_proj, down_proj) split their input features and produce partial
  sums, added across the group by ONE `tp_all_reduce` per attention block and ONE per MLP or
  MoE block (routed and shared experts add their partials before it);
- everything else (latent down-projections, norms, router, embedding, LM head) is replicated.

Nothing initialised (one process, no torch.distributed at all) means size 1, rank 0, and the
collectives are the identity. Expert- and data-parallel groups would be cut from the same
world beside the tensor-parallel one and kept in their own `ParallelGroup`.

The collectives are for inference: they do not carry gradients (training runs one process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelGroup:
    """One process group and this process's place in it (group None: a group of one)."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    rank: int  # index of this process in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_SINGLE = ParallelGroup(group=None, ranks=[0], rank=0)
_TP: ParallelGroup = _SINGLE


def init_model_parallel(tensor_parallel_size: int) -> None:
    """Cut the default process group into tensor-parallel groups of `tensor_parallel_size`
    consecutive ranks. Every rank must call it (new_group is collective). With size 1 it
    needs no torch.distributed at all."""
    global _TP
    if tensor_parallel_size == 1:
        _TP = ParallelGroup(group=None, ranks=[dist.get_rank() if dist.is_initialized() else 0], rank=0)
        return
    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel(tp > 1) needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel_size:
        raise ValueError(f"world size {world} is not divisible by tensor_parallel_size {tensor_parallel_size}")
    for start in range(0, world, tensor_parallel_size):
        ranks = list(range(start, start + tensor_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TP = ParallelGroup(group=group, ranks=ranks, rank=ranks.index(rank))


def destroy_model_parallel() -> None:
    """Forget the groups (the caller destroys the default process group itself)."""
    global _TP
    if _TP.group is not None and dist.is_initialized():
        dist.destroy_process_group(_TP.group)
    _TP = _SINGLE


def get_tp_group() -> ParallelGroup:
    return _TP


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel group, in place; the identity for a group of one."""
    return _TP.all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along `dim`, in rank order; the identity for a group of one."""
    return _TP.all_gather(x, dim)
