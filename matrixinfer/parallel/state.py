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

Expert parallelism (`init_model_parallel(tp, ep)`, world = tp * ep): global rank
`d * tp + t` is tensor-parallel rank t of attention data-parallel replica d. The ranks sharing
a tensor-parallel index t, one per replica, form expert-parallel group t: attention runs data
parallel over the replicas (each its own requests), the routed experts are partitioned over the
EP group (`expert_partition`), and the MoE layer exchanges tokens inside it (ep_comm.py). Each
expert is still sharded over its TP group like a dense MLP, so an expert's output stays a TP
partial sum added by the block's one `tp_all_reduce`.

SP-TP-SP (`init_model_parallel(1, 1, sequence_parallel_size=P)`, world = P, the paper's
prefill): all P ranks form one sequence-parallel group. Attention splits its heads over it
(`get_head_group()`, the TP group otherwise), the routed experts are partitioned over it as
the EP group, and the tensor-parallel group is a group of one: the norms, dense MLPs, shared
experts and router are whole on every rank and run on the rank's slice of the tokens
(parallel/sequence.py, docs/prefill_parallel.md).

Nothing initialised (one process, no torch.distributed at all) means size 1, rank 0, and the
collectives are the identity.

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
_EP: ParallelGroup = _SINGLE
_SP: ParallelGroup = _SINGLE


def _cut(groups: list[list[int]], rank: int) -> ParallelGroup:
    """new_group for every group (collective: every rank creates all of them); ours returned."""
    mine = _SINGLE
    for ranks in groups:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = ParallelGroup(group=group, ranks=ranks, rank=ranks.index(rank))
    return mine


def init_model_parallel(tensor_parallel_size: int, expert_parallel_size: int = 1,
                        sequence_parallel_size: int = 1) -> None:
    """Cut the default process group (world = tp * ep) into tensor-parallel groups of
    consecutive ranks and expert-parallel groups of ranks `tp` apart. Every rank must call it
    (new_group is collective). With both sizes 1 it needs no torch.distributed at all.
    sequence_parallel_size P > 1 (tp = ep = 1, world = P): one SP-TP-SP group of all ranks."""
    global _TP, _EP, _SP
    tp, ep = tensor_parallel_size, expert_parallel_size
    if sequence_parallel_size > 1:
        if (tp, ep) != (1, 1):
            raise ValueError("sequence_parallel_size > 1 takes tensor/expert_parallel_size 1: the SP group "
                             "splits the heads and holds the experts itself")
        if not dist.is_initialized() or dist.get_world_size() != sequence_parallel_size:
            raise ValueError(f"sequence_parallel_size {sequence_parallel_size} needs a process group of that size")
        rank = dist.get_rank()
        _SP = _EP = _cut([list(range(sequence_parallel_size))], rank)
        _TP = ParallelGroup(group=None, ranks=[rank], rank=0)
        return
    if tp == 1 and ep == 1:
        _TP = _EP = ParallelGroup(group=None, ranks=[dist.get_rank() if dist.is_initialized() else 0], rank=0)
        return
    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel(tp * ep > 1) needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * ep:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp} x expert_parallel_size {ep}")
    _TP = _cut([list(range(d * tp, (d + 1) * tp)) for d in range(ep)], rank)
    _EP = _cut([list(range(t, world, tp)) for t in range(tp)], rank)


def destroy_model_parallel() -> None:
    """Forget the groups (the caller destroys the default process group itself)."""
    global _TP, _EP, _SP
    for g in {id(g): g for g in (_TP, _EP, _SP)}.values():
        if g.group is not None and dist.is_initialized():
            dist.destroy_process_group(g.group)
    _TP = _EP = _SP = _SINGLE


def get_sp_group() -> ParallelGroup:
    """The SP-TP-SP group (a group of one unless init_model_parallel got sequence_parallel_size)."""
    return _SP


def get_head_group() -> ParallelGroup:
    """The group attention splits its heads over: the SP group under SP-TP-SP, else the TP group."""
    return _SP if _SP.size > 1 else _TP


def get_ep_group() -> ParallelGroup:
    """This rank's expert-parallel group; its index there is also its attention data-parallel rank."""
    return _EP


def expert_partition(num_experts: int, ep_size: int) -> list[list[int]]:
    """Routed experts of each EP rank: contiguous ranges, the first `num_experts % ep_size`
    ranks holding one more (so rank order is expert order)."""
    base, extra = divmod(num_experts, ep_size)
    out, start = [], 0
    for r in range(ep_size):
        n = base + (r < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


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
