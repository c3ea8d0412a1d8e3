"""Model parallelism: process groups and the collectives the model's layers call."""

from matrixinfer.parallel.state import (
    ParallelGroup,
    destroy_model_parallel,
    expert_partition,
    get_ep_group,
    get_head_group,
    get_sp_group,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_model_parallel,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "ParallelGroup", "destroy_model_parallel", "expert_partition", "get_ep_group", "get_head_group", "get_sp_group",
    "get_tp_group", "get_tp_rank", "get_tp_size", "init_model_parallel", "tp_all_gather", "tp_all_reduce",
]
