"""Decode and prefill step models: calibration, limits, and the comparisons in the docs."""

from dataclasses import replace

import pytest

from matrixinfer.sim import costs
from matrixinfer.sim.calibration import calibration_config, fit_overlap
from matrixinfer.sim.decode import DecodeConfig, decode_step
from matrixinfer.sim.hardware import load_hardware
from matrixinfer.sim.modelspec import load_model
from matrixinfer.sim.prefill import PrefillConfig, prefill_balance, prefill_batch

CM = load_hardware("cloudmatrix384")
H800 = load_hardware("h800")
R1 = load_model("deepseek-r1")


def test_calibration_point_is_reproduced():
    """With the fitted overlap from the hardware file: TPOT 49.4 ms and 1,943 tokens/s per NPU (0.5 %)."""
    r = decode_step(CM, R1, calibration_config(CM))
    assert r.tpot_ms == pytest.approx(49.4, rel=0.005)
    assert r.tokens_per_s_per_device == pytest.approx(1943, rel=0.005)


def test_fit_matches_the_value_in_the_hardware_file():
    """Refitting the overlap efficiency gives the value stored in cloudmatrix384.yaml."""
    f = fit_overlap(CM, R1)
    assert not f.clipped
    assert f.overlap == pytest.approx(CM.efficiency.overlap, abs=0.002)


def test_fit_is_not_a_constant():
    """The fit responds to its target: a slower measured point yields a lower overlap efficiency."""
    slower = replace(CM, calibration=replace(CM.calibration, tpot_ms=55.0))
    assert fit_overlap(slower, R1).overlap < fit_overlap(CM, R1).overlap - 0.1


def test_tpot_rises_and_throughput_saturates_with_batch():
    """More sequences per die: longer TPOT, more tokens/s per die."""
    rs = [decode_step(CM, R1, DecodeConfig(b, 4096)) for b in (8, 24, 96)]
    assert rs[0].tpot_ms < rs[1].tpot_ms < rs[2].tpot_ms
    assert rs[0].tokens_per_s_per_device < rs[1].tokens_per_s_per_device < rs[2].tokens_per_s_per_device


def test_microbatch_overlap_helps_and_host_syncs_cost():
    """Two microbatches beat one; unpipelined MTP adds exactly (k+1) host syncs of 0.7 ms."""
    base = decode_step(CM, R1, DecodeConfig(96, 4096))
    assert decode_step(CM, R1, DecodeConfig(96, 4096, microbatches=1)).tpot_ms > base.tpot_ms
    slow = decode_step(CM, R1, DecodeConfig(96, 4096, pipelined_mtp=False))
    assert slow.step_ms - base.step_ms == pytest.approx(2 * 0.7)


def test_mtp_pays_off_only_while_memory_bound():
    """MTP doubles the verified tokens: at 8 seqs/die (weight reads dominate) it cuts TPOT by > 30 %;
    at 96 seqs/die the step is compute-bound and 1.7 tokens for ~2x the work no longer pays."""
    def gain(b):
        return decode_step(CM, R1, DecodeConfig(b, 4096, mtp_drafts=0)).tpot_ms / decode_step(CM, R1, DecodeConfig(b, 4096)).tpot_ms
    assert gain(8) > 1.3
    assert gain(96) < 1.0


def test_expert_imbalance_slows_decode():
    """A busiest expert die at 1.5x the mean load makes the step longer."""
    assert decode_step(CM, R1, DecodeConfig(96, 4096, expert_imbalance=1.5)).step_ms > \
        decode_step(CM, R1, DecodeConfig(96, 4096)).step_ms


def test_h800_low_latency_dispatch_matches_deepep():
    """Not fitted: DeepEP LL on H800 (SPEC) dispatch 163..194 us, combine 318..360 us at EP8..EP256;
    the RDMA plane model lands within 12 %."""
    for ep, disp, comb in ((8, 163, 318), (256, 194, 360)):
        c = costs.ep_comm(H800, R1, 128, ep, "fp8", "bf16", plane="scale_out", dedup_ranks=False)
        assert c.dispatch_s * 1e6 == pytest.approx(disp, rel=0.12)
        assert c.combine_s * 1e6 == pytest.approx(comb, rel=0.12)


def test_prefill_close_to_published_cloudmatrix_throughput():
    """Not fitted: the paper's 6,688 prefill tokens/s per NPU (4K prompts) within 15 %."""
    r = prefill_batch(CM, R1, PrefillConfig())
    assert r.tokens_per_s_per_device == pytest.approx(6688, rel=0.15)


def test_context_cache_ub_beats_vpc():
    """With 90 % of the prompt cached, reading pages over UB gives a shorter TTFT than over VPC,
    and both beat recomputing."""
    none = prefill_batch(CM, R1, PrefillConfig())
    ub = prefill_batch(CM, R1, PrefillConfig(cache_hit=0.9, page_plane="ub"))
    vpc = prefill_batch(CM, R1, PrefillConfig(cache_hit=0.9, page_plane="vpc"))
    assert ub.ttft_s < vpc.ttft_s < none.ttft_s
    assert vpc.kv_load_s / ub.kv_load_s > 10


def test_dp_equals_sptp_balance_on_equal_lengths():
    """Equal prompts spread evenly: DP is perfectly balanced (efficiency 1)."""
    b = prefill_balance(CM, R1, [4096] * 64, devices=32)
    assert b.dp_efficiency == pytest.approx(1.0)


def test_sptp_wins_on_mixed_lengths():
    """One 32K prompt among 2K ones: DP waits for the long one, SP-TP-SP spreads it (> 2x)."""
    b = prefill_balance(CM, R1, [32768] + [2048] * 63, devices=32)
    assert b.dp_efficiency < 0.5
    assert b.speedup > 2


def test_model_without_mtp_module_does_not_draft():
    """A config without num_nextn_predict_layers decodes one token per step even if MTP is asked for."""
    no_mtp = replace(R1, mtp_layers=0)
    asked = decode_step(CM, no_mtp, DecodeConfig(32, 4096, mtp_drafts=1))
    plain = decode_step(CM, R1, DecodeConfig(32, 4096, mtp_drafts=0))
    assert asked.tokens_per_step == 1
    assert asked.step_ms == pytest.approx(plain.step_ms)
