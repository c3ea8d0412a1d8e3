"""Without torch.distributed the parallel state is a group of one and the collectives are
the identity, so a single process needs no process group."""

import torch
import torch.distributed as dist

from matrixinfer.parallel import (
    destroy_model_parallel,
    get_tp_rank,
    get_tp_size,
    init_model_parallel,
    tp_all_gather,
    tp_all_reduce,
)


def test_single_process_is_a_group_of_one_with_identity_collectives():
    assert not dist.is_initialized()
    init_model_parallel(1)
    try:
        assert (get_tp_rank(), get_tp_size()) == (0, 1)
        x = torch.arange(6.0).view(2, 3)
        assert tp_all_reduce(x) is x
        assert tp_all_gather(x, dim=0) is x
    finally:
        destroy_model_parallel()
    assert get_tp_size() == 1
