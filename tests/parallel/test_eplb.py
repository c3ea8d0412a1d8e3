"""EPLB: the placement algorithm (pure), and an online rebalance across two real processes
that moves expert weights between ranks and leaves the logits equal to the single-process
model's within float32 rounding (1e-5), before and after every move."""

from __future__ import annotations

import pytest
import torch

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.model.loader import load_model
from matrixinfer.model.moe import MoE
from matrixinfer.parallel import expert_partition, get_ep_group
from matrixinfer.parallel.ep_comm import EPDispatcher, set_dispatcher
from matrixinfer.parallel.eplb import (
    ExpertBalancer,
    balanced_packing,
    imbalance,
    rebalance,
    replicate,
    static_placement,
)
from matrixinfer.parallel.spawn import run_ranks

TIMEOUT_S = 120


def test_replicas_go_to_the_experts_with_the_most_tokens_per_replica():
    # 90 -> 45 per replica (> 30) -> 30, tying expert 2's 30: the lower id wins
    assert replicate([90.0, 10.0, 30.0, 20.0], 7) == ([0, 1, 2, 3, 0, 0, 0], [4, 1, 1, 1])
    assert replicate([90.0, 10.0, 40.0, 20.0], 7) == ([0, 1, 2, 3, 0, 0, 2], [3, 1, 2, 1])


def test_balanced_packing_fills_every_pack_to_its_capacity_heaviest_first():
    pack = balanced_packing([5.0, 4.0, 3.0, 3.0, 1.0], [3, 2])
    assert [pack.count(0), pack.count(1)] == [3, 2]
    assert pack == [0, 1, 1, 0, 0]  # 5 | 4, 3 | 3 joins the lighter (5 vs 7), 1 fills the room left


def test_rebalance_returns_consistent_maps_and_evens_a_skewed_load():
    load = [1000 / (i + 1) ** 1.2 for i in range(64)]  # Zipf-like router
    before = imbalance(static_placement(64, 8).rank_loads(load))
    p = rebalance(load, 8, 16)
    assert len(p.phy2log) == 80 and p.slots == [10] * 8
    for e, phys in enumerate(p.log2phy()):
        assert [q for q in phys if q >= 0] == [q for q, x in enumerate(p.phy2log) if x == e]
        assert len([q for q in phys if q >= 0]) == p.logcnt[e]
    after = imbalance(p.rank_loads(load))
    assert before > 3 and after < 1.05
    uneven = rebalance([3.0, 1, 1, 1, 1, 1, 1], 2, 0)  # 7 experts on 2 ranks: 4 + 3 slots
    assert uneven.slots == [4, 3] and sorted(uneven.phy2log) == list(range(7))


def _rank_main(rank: int, world: int) -> tuple:
    """Three forwards of this rank's tokens with a rebalance (from what was routed) after each."""
    group = get_ep_group()
    model = load_model(DEFAULT_MODEL, dtype="float32", expert_ids=expert_partition(8, world)[rank])
    cfg = model.config
    owner = [r for r, ids in enumerate(expert_partition(8, world)) for _ in ids]
    d = EPDispatcher(group, owner, cfg.num_experts_per_tok, cfg.hidden_size, 64, "float32", torch.float32)
    set_dispatcher(d)
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    balancer = ExpertBalancer(moes, group, num_redundant=2, interval=1, window=4, device="cpu")
    ids = torch.randint(2, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(10 + rank))
    pos = torch.arange(12).expand(2, 12)
    d.set_step_tokens(24)
    out, held = [], []
    with torch.inference_mode():
        for _ in range(3):
            held.append([list(m.experts.expert_ids) for m in moes])
            out.append(model.compute_logits(model(ids, pos)).numpy())
            balancer.end_step()
    return ids.numpy(), out, held, balancer.moves


@pytest.mark.slow
def test_online_rebalance_moves_experts_and_keeps_the_outputs():
    got = run_ranks(_rank_main, 2, ep=2, timeout=TIMEOUT_S)
    single = load_model(DEFAULT_MODEL, dtype="float32")
    for rank, (ids, out, held, moves) in got.items():
        assert moves > 0 and held[0] != held[1], f"rank {rank}: the rebalance moved nothing"
        with torch.inference_mode():
            ref = single.compute_logits(single(torch.from_numpy(ids), torch.arange(12).expand(2, 12)))
        for step, logits in enumerate(out):
            err = ((torch.from_numpy(logits) - ref).abs().max()).item()
            assert err < 1e-5, f"rank {rank} step {step}: max |logit difference| {err:.2e}"
        # not bit-identical: an expert's rows now split over replicas, and a matmul's rounding
        # depends on how many rows it multiplies; within float32 rounding of the same sums
        assert max(abs(o - out[0]).max() for o in out) < 1e-5


def test_moving_experts_repacks_the_few_rows_operators_copy():
    """After move_experts refills a layer's slots, the few-rows operator's packed copies
    (kernels.pack_small_mm) hold the moved weights, not the slots' old ones: each slot's
    output equals F.linear with the weights now in that slot (bfloat16 rounding)."""
    from matrixinfer.kernels import load_cpu_ops, small_mm, small_mm_serves
    from matrixinfer.model.layers.experts import RoutedExperts
    from matrixinfer.parallel.eplb import Placement, move_experts
    from matrixinfer.parallel.state import ParallelGroup

    if not (load_cpu_ops() and small_mm_serves(torch.bfloat16, torch.device("cpu"))):
        pytest.skip("this CPU's build has no bfloat16 small_mm")
    experts = RoutedExperts(4, 32, 16, params_dtype=torch.bfloat16)
    with torch.no_grad():
        for p in (experts.w13_weight, experts.w2_weight):
            p.normal_()
    experts.quant_method.pack_small_mm(experts)
    before = experts.w13_weight.clone()
    move_experts(experts, Placement([0, 1, 2, 3], [4], [1] * 4), Placement([3, 2, 1, 0], [4], [1] * 4),
                 ParallelGroup(None, [0], 0))
    assert torch.equal(experts.w13_weight, before.flip(0))
    x = torch.randn(4, 32).bfloat16()
    got = small_mm(x, experts.small_mm_weights[0], torch.arange(4))
    ref = torch.stack([torch.nn.functional.linear(x[s].float(), experts.w13_weight[s].float()) for s in range(4)])
    assert ((got.float() - ref).abs().max() / ref.abs().max()) < 1e-2
