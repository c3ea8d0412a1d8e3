"""The single-device engine model (sim/local.py) and `simulate validate` end to end."""

import json
from pathlib import Path

import pytest
import yaml

from matrixinfer.sim import local
from matrixinfer.sim.hardware import hardware_from_dict
from matrixinfer.sim.modelspec import load_model

TINY = "models/matrixinfer-tiny-moe"
LOCAL = {"name": "toy", "devices": 1, "devices_per_node": 1,
         "device": {"name": "toy", "per_package": 1, "tflops": {"fp32": 1.0}, "hbm_gb": 16, "hbm_tb_s": 0.01},
         "efficiency": {"mla_compute": 0.5, "mla_memory": 1.0, "gemm": {"fp32": 1.0}, "link": 1.0, "overlap": 1.0},
         "planes": {"scale_up": {"name": "g", "gb_s": 1, "latency_us": 50}, "scale_out": {"name": "g", "gb_s": 1,
                    "latency_us": 50}, "vpc_node_gb_s": 1},
         "host": {"step_overhead_us": 1000, "per_seq_us": 100, "op_launch_us": 10}}


def test_host_terms_add_to_the_operators():
    """Step = operators + 1,000 us + 100 us per sequence + 10 us per operator."""
    hw, m = hardware_from_dict(LOCAL), load_model(TINY)
    bare = local.decode_step(hardware_from_dict(LOCAL | {"host": {}}), m, 4, 128)
    step = local.decode_step(hw, m, 4, 128)
    assert step.n_ops == 4 + 3 * 5 + 1  # proj, gather, core + dense FFN (layer 0) or gate + experts; lm_head
    assert step.time_s - bare.time_s == pytest.approx((1000 + 4 * 100 + 10 * step.n_ops) * 1e-6)


def test_prefill_factor_scales_prefill_operators_only():
    """The fitted eager-prefill factor multiplies the prefill operators, not the host terms or decode."""
    m = load_model(TINY)
    hw1 = hardware_from_dict(LOCAL)
    hw2 = hardware_from_dict(LOCAL | {"host": LOCAL["host"] | {"prefill_factor": 2.0}})
    p1, p2 = local.prefill_step(hw1, m, 2, 128), local.prefill_step(hw2, m, 2, 128)
    assert p2.ops_s == pytest.approx(2 * p1.ops_s) and p2.host_s == pytest.approx(p1.host_s)
    assert local.decode_step(hw2, m, 4, 128).time_s == pytest.approx(local.decode_step(hw1, m, 4, 128).time_s)


def test_latent_gather_reads_and_writes_every_cached_token():
    """Paged decode copies batch x KV latents (80 floats of 4 B) per layer: read + write."""
    m = load_model(TINY)
    gather = [o for o in local.decode_ops(m, 4, 100, "fp32") if o.name == "latent_gather"]
    assert len(gather) == m.layers and gather[0].bytes == 2 * 4 * 100 * 80 * 4


def test_moe_reads_only_touched_experts():
    """One token with top-2 reads 2 routed + 1 shared experts; 16 tokens read all 8 + 1
    (plus the activations of 3 token-expert pairs per token)."""
    m = load_model(TINY)
    exp = lambda b: [o for o in local.decode_ops(m, b, 8, "fp32") if o.name == "experts"][0]  # noqa: E731
    assert exp(1).bytes - 3 * m.hidden * 4 == 3 * m.expert_params() * 4
    assert exp(16).bytes - 48 * m.hidden * 4 == 9 * m.expert_params() * 4


def test_generate_run_combines_prefill_and_decode():
    """Throughput = batch x N / (TTFT + (N - 1) x step)."""
    hw, m = hardware_from_dict(LOCAL), load_model(TINY)
    r = local.generate_run(hw, m, 2, 64, 9)
    assert r.throughput_tok_s == pytest.approx(2 * 9 / (r.ttft_s + 8 * r.decode_step_s))


def test_validate_json_end_to_end(tmp_path, capsys):
    """`simulate validate --json` on a tiny setting: one JSON object on the last line with rows and max_rel_error."""
    from tests.sim.test_paper_tables import main

    hw = tmp_path / "hw.yaml"
    hw.write_text(yaml.safe_dump(LOCAL))
    assert Path(TINY).exists()
    assert main(["simulate", "validate", "--hardware", str(hw), "--model", TINY, "--batches", "2",
                 "--prompt-lens", "16", "--max-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["rows"]) == 1 and out["rows"][0]["measured_decode_step_ms"] > 0
    assert out["max_rel_error"] == pytest.approx(max(out["rows"][0]["rel_error"].values()))
