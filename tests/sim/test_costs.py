"""The pure cost functions against hand-computed cases."""

import math

import pytest

from matrixinfer.sim import costs
from matrixinfer.sim.costs import Op, OpTimes
from matrixinfer.sim.decode import mtp_tokens_per_step
from matrixinfer.sim.hardware import PlaneSpec, load_hardware
from matrixinfer.sim.modelspec import load_model

CM = load_hardware("cloudmatrix384")
R1 = load_model("deepseek-r1")


def test_roofline_compute_bound_gemm():
    """1 TFLOP of INT8 with no traffic: 1e12 / (752e12 * 0.80) s."""
    t = costs.op_time(Op("g", 1e12, 0.0, "int8"), CM)
    assert t.time_s == pytest.approx(1e12 / (752e12 * 0.80))
    assert t.memory_s == 0


def test_roofline_memory_bound_read():
    """1 GB read and no FLOPs: 1e9 / (1.6e12 * 0.841) s, the measured HBM efficiency."""
    t = costs.op_time(Op("r", 0.0, 1e9, "int8"), CM)
    assert t.time_s == pytest.approx(1e9 / (1.6e12 * 0.841))


def test_attention_uses_mla_compute_efficiency():
    """An attention op is costed at 65.4 % of BF16 peak, not the GEMM efficiency."""
    t = costs.op_time(Op("a", 1e12, 0.0, "bf16", kind="attention"), CM)
    assert t.compute_s == pytest.approx(1e12 / (376e12 * 0.654))


def test_absorbed_mla_flops_per_query_position():
    """Absorbed MLA: 128 heads x 2 x (576 score + 512 value) FLOPs per (query, position)."""
    assert costs.attention_core_flops_per_query_pos(R1, absorbed=True) == 2 * 128 * (576 + 512)
    assert costs.attention_core_flops_per_query_pos(R1, absorbed=False) == 2 * 128 * (192 + 128)


def test_kv_read_of_decode_attention():
    """48 seqs x 4096 positions x 576 BF16 latents = 453 MB read per layer."""
    op = costs.attention_core_op(R1, 96 * 4096, 48 * 4096, "bf16", absorbed=True)
    assert op.bytes == 48 * 4096 * 576 * 2


def test_causal_pairs():
    """A 4-token prompt attends 1+2+3+4 = 10 pairs; with 2 cached, 3+4 = 7."""
    assert costs.causal_pairs(4) == 10
    assert costs.causal_pairs(4, 2) == 7


def test_token_bytes_match_spec():
    """INT8 token with scale and metadata is 7.5 KB; BF16 is 14 KB (SPEC)."""
    assert costs.token_bytes(7168, "int8") == 7.5 * 1024
    assert costs.token_bytes(7168, "bf16") == 14 * 1024


def test_expected_distinct_ranks():
    """One expert per rank: top-k ranks; 4 experts on 2 ranks, top-2: 2 * (1 - C(2,2)/C(4,2)) = 5/3."""
    assert costs.expected_distinct_ranks(8, 256, 320) == 8
    assert costs.expected_distinct_ranks(2, 4, 2) == pytest.approx(5 / 3)


def test_all_to_all_time_hand_case():
    """1 MB over a 100 GB/s plane at 90 %: 2 us latency + 11.11 us + 10 peers x 0.1 us."""
    plane = PlaneSpec("p", 100.0, 2.0, 0.1, 0)
    t = costs.all_to_all_time(1e6, 10, plane, 0.9)
    assert t == pytest.approx(2e-6 + 1e6 / 90e9 + 1e-6)


def test_decode_dispatch_bytes_on_ub():
    """EP320 decode: 96 tokens x (8 routed + 1 shared) copies x 7,680 B x 319/320 leave each die;
    the payload term is 2 us latency + bytes / (196 GB/s x 0.9) + 319 flag writes x 0.05 us + handshake."""
    c = costs.ep_comm(CM, R1, 96, 320, "int8", extra_dests=1, plane="scale_up", dedup_ranks=False)
    expected = 96 * 9 * 7680 * 319 / 320
    assert c.dispatch_bytes == pytest.approx(expected)
    wire = 2e-6 + expected / (196e9 * 0.9) + 319 * 0.05e-6
    assert c.dispatch_terms["payload"] == pytest.approx(wire + CM.collective.handshake_us * 1e-6)
    assert c.dispatch_s == pytest.approx(sum(c.dispatch_terms.values()))


def _toy_hw(launch=1.0, handshake=10.0, rounds=1.0):
    """1 TB/s HBM at efficiency 0.5 (2 us per MB), 100 GB/s plane at 0.9, 2 us latency, 0.1 us per peer."""
    from dataclasses import replace

    from matrixinfer.sim.hardware import CollectiveSpec

    return replace(CM, device=replace(CM.device, hbm_tb_s=1.0),
                   efficiency=replace(CM.efficiency, mla_memory=0.5, link=0.9),
                   scale_up=PlaneSpec("p", 100.0, 2.0, 0.1, 0),
                   collective=CollectiveSpec(launch, handshake, rounds))


def test_dispatch_terms_hand_case():
    """100 tokens of hidden 1,000, 4 copies each, INT8 on the wire (1,000 + 4 + 508 = 1,512 B):
    quantize reads 200 KB and writes 151.2 KB (0.7024 us); metadata round 2 + 10 + 3 x 0.1 us;
    reorder reads + writes 4 x 151.2 KB (1.2096 us); launch 1 us; payload = wire + 10 us."""
    hw = _toy_hw()
    t = costs.dispatch_terms(hw, hw.scale_up, 100, 4, 1000, "int8", wire_s=5e-6, peers=3)
    assert t["launch"] == pytest.approx(1e-6)
    assert t["quantize"] == pytest.approx((200_000 + 151_200) / 0.5e12)
    assert t["metadata"] == pytest.approx(12.3e-6)
    assert t["payload"] == pytest.approx(15e-6)
    assert t["reorder"] == pytest.approx(2 * 4 * 151_200 / 0.5e12)


def test_combine_has_no_quantize_or_metadata_round():
    """BF16 combine of 100 tokens x 4 copies of hidden 1,000: launch 1 us, payload wire + 10 us,
    reduce reads 800 KB and writes 200 KB (2 us)."""
    t = costs.combine_terms(_toy_hw(), 100, 4, 1000, "bf16", wire_s=5e-6)
    assert t == pytest.approx({"launch": 1e-6, "payload": 15e-6, "reduce": 2e-6})


def test_no_metadata_round_when_counts_travel_with_data():
    """metadata_rounds 0 (DeepEP low-latency) drops the metadata term."""
    hw = _toy_hw(rounds=0.0)
    assert costs.dispatch_terms(hw, hw.scale_up, 100, 4, 1000, "int8", 5e-6, 3)["metadata"] == 0


def test_collective_fit_reproduces_the_measured_pair_and_the_file():
    """The two fitted costs give dispatch 116 us and combine 118 us at EP8, 128 tokens, and
    equal the values stored in cloudmatrix384.yaml (to the stored rounding)."""
    from matrixinfer.sim.calibration import fit_collectives

    f = fit_collectives(CM, R1)
    assert (f.dispatch_us, f.combine_us) == pytest.approx((116.0, 118.0))
    assert f.launch_us == pytest.approx(CM.collective.launch_us, abs=0.01)
    assert f.handshake_us == pytest.approx(CM.collective.handshake_us, abs=0.01)


def test_collective_fit_moves_with_its_targets():
    """A slower measured dispatch (+1 us) raises the handshake by 1 us and lowers launch by 1 us."""
    from dataclasses import replace

    from matrixinfer.sim.calibration import fit_collectives

    base = fit_collectives(CM, R1)
    slow = fit_collectives(replace(CM, collective_calibration=replace(CM.collective_calibration, dispatch_us=117)), R1)
    assert slow.handshake_us - base.handshake_us == pytest.approx(1.0)
    assert slow.launch_us - base.launch_us == pytest.approx(-1.0)


def test_eplb_uniform_is_balanced():
    """Uniform expert load with one slot per expert: imbalance 1."""
    assert costs.eplb_imbalance([1.0] * 8, 8) == pytest.approx(1.0)


def test_eplb_replicates_the_hot_expert():
    """Loads [3, 1] with 3 slots: the hot expert gets the replica -> slots 1.5, 1.5, 1; max/mean = 1.125."""
    assert costs.eplb_slot_loads([3.0, 1.0], 3) == [1.5, 1.5, 1.0]
    assert costs.eplb_imbalance([3.0, 1.0], 3) == pytest.approx(1.5 / (4 / 3))
    skewed = costs.zipf_loads(256, 1.0)
    assert costs.eplb_imbalance(skewed, 288) < costs.eplb_imbalance(skewed, 256)


def test_overlap_bounds():
    """Two paths of 3 and 2 (compute 2 and 1): perfect overlap 3, none 5, half 4."""
    a, b = OpTimes(3.0, 2.0, 0.5), OpTimes(2.0, 1.0, 0.5)
    assert costs.overlapped_time(a, b, 1.0) == 3.0
    assert costs.overlapped_time(a, b, 0.0) == 5.0
    assert costs.overlapped_time(a, b, 0.5) == 4.0


def test_overlap_never_beats_shared_compute():
    """Two compute-bound paths of 1 each cannot overlap below their summed compute (2)."""
    a = OpTimes(1.0, 1.0, 0.0)
    assert costs.overlapped_time(a, a, 1.0) == 2.0


def test_mtp_tokens_per_step():
    """k drafts accepted in a row with probability a: 1 + a + ... + a^k."""
    assert mtp_tokens_per_step(1, 0.7) == pytest.approx(1.7)
    assert mtp_tokens_per_step(2, 0.5) == pytest.approx(1.75)
    assert mtp_tokens_per_step(0, 0.9) == 1
    assert math.isclose(mtp_tokens_per_step(3, 1.0), 4)


def test_sensitivity_covers_every_non_fact_constant():
    """Every constant not sourced as a hardware fact (targets aside) gets a row; the calibration
    TPOT moves with the GEMM efficiency and not with the RDMA latency (decode runs on UB)."""
    from matrixinfer.sim.sensitivity import SKIP, sensitivity

    rows = {r["constant"]: r for r in sensitivity()}
    expected = {k for k, v in CM.sources.items() if not v.startswith("hardware fact") and not k.startswith(SKIP)}
    assert set(rows) == expected
    assert rows["efficiency.gemm.int8"]["decode_tpot_ms_minus"] > 0.01
    assert rows["planes.scale_out.latency_us"]["decode_tpot_ms_plus"] == pytest.approx(0, abs=1e-9)
