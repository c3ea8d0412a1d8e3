"""The fused dispatch/combine in one process (an EP group of one: the exchange is a copy), the
row format, and the sticky placement of requests on data-parallel ranks."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.model.loader import load_model
from matrixinfer.parallel.ep_comm import EPDispatcher, RowLayout
from matrixinfer.parallel.state import ParallelGroup
from matrixinfer.worker.data_parallel import RequestPlacement, split_microbatches

ONE = ParallelGroup(group=None, ranks=[0], rank=0)


@pytest.fixture(scope="module")
def moe():
    model = load_model(DEFAULT_MODEL, dtype="float32")
    return model.model.layers[2].mlp


def _routed(moe, n: int, seed: int = 0):
    x = torch.randn(n, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed))
    weights, ids = moe.gate(x)
    return x, weights, ids


def _dispatcher(moe, dtype: str, max_tokens: int = 32) -> EPDispatcher:
    return EPDispatcher(ONE, [0] * moe.experts.num_experts, moe.gate.top_k, moe.gate.weight.shape[1], max_tokens,
                        dtype, torch.float32)


@torch.inference_mode()
def test_float32_dispatch_gives_exactly_the_local_experts_output(moe):
    d = _dispatcher(moe, "float32")
    x, w, ids = _routed(moe, 21)
    d.set_step_tokens(21)
    assert torch.equal(d(x, w, ids, moe.experts), moe.experts(x, w, ids, path="grouped"))  # the path EP runs


@torch.inference_mode()
def test_int8_dispatch_is_within_one_percent_of_the_local_experts(moe):
    d = _dispatcher(moe, "int8")
    x, w, ids = _routed(moe, 21)
    d.set_step_tokens(21)
    ref = moe.experts(x, w, ids, path="grouped")
    err = ((d(x, w, ids, moe.experts) - ref).norm() / ref.norm()).item()
    assert 0 < err < 1e-2  # lossy (per-token int8), but by well under a percent


class _Allocations(TorchDispatchMode):
    """Bytes of tensors created by ops, except inside `pause` (the experts' own computation)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        known = {a.untyped_storage().data_ptr() for a in list(args) + list(kwargs.values())
                 if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        if not self.paused:
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                    self.bytes += t.untyped_storage().nbytes()
        return out


@torch.inference_mode()
def test_buffers_are_static_and_a_call_allocates_only_small_index_tensors(moe):
    d = _dispatcher(moe, "int8")
    pointers = [t.data_ptr() for s in d.sets for t in s.tensors()]
    experts = moe.experts
    mode = _Allocations()
    apply = experts.quant_method.apply

    def paused_apply(*a):
        mode.paused = True
        try:
            return apply(*a)
        finally:
            mode.paused = False

    experts.quant_method.apply = paused_apply
    try:
        for n in (32, 5, 0, 17, 32):
            x, w, ids = _routed(moe, n, seed=n)
            d.set_step_tokens(n)
            mode.bytes = 0
            with mode:
                d(x, w, ids, experts)
            # index tensors: O(tokens x top_k) int64s, never hidden-sized rows ([n, 256] float32 is n KiB)
            bound = 128 * n * moe.gate.top_k + 1024
            assert mode.bytes <= bound, f"{n} tokens: {mode.bytes} bytes allocated (bound {bound})"
    finally:
        del experts.quant_method.apply
    assert [t.data_ptr() for s in d.sets for t in s.tensors()] == pointers


def test_int8_rows_are_at_most_055_of_bfloat16_rows_metadata_included():
    for hidden, k in ((256, 2), (7168, 8)):  # the bundled model; DeepSeek-V3
        int8, bf16 = RowLayout(hidden, k, "int8"), RowLayout(hidden, k, "bfloat16")
        assert int8.row_bytes == hidden + 4 + 4 * k + 2 * k  # payload, scale, weights, ids
        assert int8.row_bytes / bf16.row_bytes <= 0.55


def test_a_step_announcing_fewer_tokens_than_a_rank_has_is_refused(moe):
    d = _dispatcher(moe, "float32")
    x, w, ids = _routed(moe, 9)
    d.set_step_tokens(8)
    with pytest.raises(ValueError, match="at most 8"):
        d(x, w, ids, moe.experts)
    with pytest.raises(ValueError, match="exceed"):
        d.set_step_tokens(33)


def _req(rid: str) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], 0, [0], sample=True)


def test_placement_is_sticky_least_loaded_and_frees_finished_requests():
    p = RequestPlacement(2)
    assert p.place([_req("a"), _req("b"), _req("c")]) == [0, 1, 0]
    assert p.place([_req("c"), _req("a")]) == [0, 0]  # sticky, in the order asked
    p.finish(["a", "c", "unknown"])
    assert p.place([_req("d"), _req("e"), _req("b")]) == [0, 0, 1]  # rank 0 was empty, then tied


def test_microbatches_split_a_rank_s_requests_by_tokens_keeping_order():
    reqs = [(ScheduledRequest(f"r{i}", [1] * n, 0, [0], sample=True), n == 1) for i, n in enumerate((1, 1, 1, 9, 4))]
    first, second = split_microbatches(reqs, 2)
    assert [r.request_id for r, _ in first] == ["r0", "r1", "r2", "r3"] and first + second == reqs  # 12 | 4
    assert split_microbatches(reqs[:1], 2) == [reqs[:1], []]
    assert split_microbatches([], 2) == [[], []]
    assert split_microbatches(reqs, 1) == [reqs]
