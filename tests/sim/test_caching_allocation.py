"""EMS model cache and the supernode allocation study."""

import pytest

from matrixinfer.sim.allocation import Supernode, block_size_distribution, clos_cost, simulate_allocation
from matrixinfer.sim.caching import model_cache
from matrixinfer.sim.hardware import load_hardware

CM = load_hardware("cloudmatrix384")


def test_model_cache_hand_case():
    """8 x 671 GB at 2.5 GB/s shared: 2,147.2 s direct. Through EMS: 268.4 s once, then
    8 x 671 GB from the pool at min(8 x 32 dies x 196 x 0.9, 192 sockets x 160 x 0.9) GB/s."""
    r = model_cache(CM, 671, 8, 2.5)
    assert r.direct_s == pytest.approx(2147.2)
    read = min(8 * 32 * 196 * 0.9, 192 * 160 * 0.9)
    assert r.pool_read_gb_s == pytest.approx(read)
    assert r.ems_s == pytest.approx(268.4 + 8 * 671 / read)


def test_block_distribution_hits_the_mean():
    """The max-entropy distribution over powers of two has the requested mean."""
    sizes, probs = block_size_distribution(10.08)
    assert sum(probs) == pytest.approx(1)
    assert sum(s * p for s, p in zip(sizes, probs)) == pytest.approx(10.08, abs=1e-6)


def test_supernode_merges_freed_runs():
    """Allocate 3 blocks, free the middle then the first: one run [0, 8) is free again."""
    sn = Supernode(12)
    a, b, c = sn.allocate(4), sn.allocate(4), sn.allocate(4)
    assert (a, b, c) == (0, 4, 8) and sn.allocate(1) is None
    sn.release(b, 4)
    sn.release(a, 4)
    assert sn.free == [[0, 8]]


def test_rate_is_one_when_block_divides_supernode():
    """Blocks of 8 in supernodes of 384: nothing is ever stranded (contiguous or not)."""
    for contiguous in (True, False):
        r = simulate_allocation(384, 8, support=(8,), jobs=3000, contiguous=contiguous)
        assert r.allocation_rate == pytest.approx(1.0)


def test_rate_when_block_does_not_divide():
    """Blocks of 4 in supernodes of 10: two fit, 2 devices idle -> 0.8."""
    r = simulate_allocation(10, 4, total_devices=100, support=(4,), jobs=3000)
    assert r.allocation_rate == pytest.approx(0.8)


def test_bigger_supernodes_allocate_more():
    """Same jobs (mean 10.08): 2,048-device supernodes strand less than 224-device ones."""
    small = simulate_allocation(224, 10.08, jobs=8000, window=1, contiguous=False).allocation_rate
    big = simulate_allocation(2048, 10.08, jobs=8000, window=1, contiguous=False).allocation_rate
    assert 0.5 < small < big <= 1.0
    assert big - small > 0.03


def test_clos_reproduces_cloudmatrix_switch_counts():
    """768 dies, 7 planes, 16+16-port L1, 48-port L2: 336 L1 chips (48 nodes x 7) and
    112 L2 chips (7 sub-planes x 16), every port used; one more node no longer fits two tiers."""
    c = clos_cost(768)
    assert (c.l1_switches, c.l2_switches, c.feasible) == (336, 112, True)
    assert c.port_utilisation == pytest.approx(1.0)
    assert not clos_cost(768 + 16).feasible


def test_contiguous_blocks_are_the_default_and_cost_allocation():
    """The paper's blocks are contiguous by default; relaxing contiguity can only allocate more."""
    import inspect

    assert inspect.signature(simulate_allocation).parameters["contiguous"].default is True
    strict = simulate_allocation(224, 10.08, jobs=4000, window=1, seed=3).allocation_rate
    relaxed = simulate_allocation(224, 10.08, jobs=4000, window=1, seed=3, contiguous=False).allocation_rate
    assert strict < relaxed


def test_context_cache_is_not_free():
    """A 90 % hit pays a lookup per prompt (2 x 2 us UB latency + 10 us) and page reads, and the
    new tokens' attention over the cached prefix remains."""
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model
    from matrixinfer.sim.prefill import PrefillConfig, prefill_batch

    r = prefill_batch(load_hardware("cloudmatrix384"), load_model("deepseek-r1"), PrefillConfig(cache_hit=0.9))
    assert r.breakdown_s["lookup"] == pytest.approx(4 * 14e-6)  # 16,384 / 4,096 prompts per die
    assert r.breakdown_s["kv_load"] > 0 and r.breakdown_s["prefix_attention_per_layer"] > 0
    assert r.ttft_s == pytest.approx(r.batch_s + r.kv_load_s)
