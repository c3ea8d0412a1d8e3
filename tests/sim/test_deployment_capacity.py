"""The deployment file, HBM capacity checks, and `simulate deployment`."""

import json

import pytest

from matrixinfer.deployment import load_deployment
from matrixinfer.sim.capacity import hbm_check, weight_bytes_per_device
from matrixinfer.sim.hardware import load_hardware
from matrixinfer.sim.modelspec import load_model

CM = load_hardware("cloudmatrix384")
R1 = load_model("deepseek-r1")
PDC = """model: deepseek-r1
dtype: int8
colocated: false
prefill: {instances: 6, expert_parallel_size: 32, prefill_parallel: sp-tp-sp}
decode: {instances: 1, expert_parallel_size: 320, dispatch_dtype: int8, speculative_num_tokens: 1}
ems: {servers: 192}
"""


def _write(tmp_path, text):
    p = tmp_path / "dep.yaml"
    p.write_text(text)
    return p


def test_pdc_file_loads_with_devices(tmp_path):
    """6 prefill instances x 32 dies + 1 decode instance x 320 dies = 512 devices."""
    d = load_deployment(_write(tmp_path, PDC))
    assert (d.colocated, d.prefill.devices, d.decode.devices, d.devices, d.ems_servers) == (False, 32, 320, 512, 192)
    assert d.prefill.prefill_parallel == "sp-tp-sp" and d.decode.speculative_num_tokens == 1


@pytest.mark.parametrize("text, field", [
    (PDC.replace("expert_parallel_size: 320", "expert_parallel_size: 0"), "decode.expert_parallel_size"),
    (PDC.replace("sp-tp-sp", "ring"), "prefill.prefill_parallel"),
    (PDC.replace("dtype: int8", "dtype: fp4"), "dtype"),
    (PDC.replace("dispatch_dtype: int8", "dispatch_dtype: int4"), "decode.dispatch_dtype"),
    (PDC.replace("model: deepseek-r1\n", ""), "model"),
    (PDC.replace("colocated: false\n", "colocated: true\n"), "prefill"),
    (PDC + "tensor_paralel_size: 2\n", "tensor_paralel_size"),
])
def test_bad_field_is_named(tmp_path, text, field):
    """Each invalid field is named in the ValueError."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_deployment(_write(tmp_path, text))


def test_weights_per_decode_die_hand_count():
    """EP320 INT8: attention 61 x 187.1 M + 3 dense FFNs x 396 M at 1 B, embedding + head
    2 x 129,280 x 7,168 x 2 B, one routed + one shared expert (44 M each) + the BF16 gate on 58 layers."""
    got = weight_bytes_per_device(R1, "int8", tp=1, ep=320)
    hand = (61 * R1.attention_params() + 3 * R1.dense_ffn_params()) + 2 * 129280 * 7168 * 2 \
        + 58 * (2 * R1.expert_params() + 7168 * 256 * 2)
    assert got == pytest.approx(hand)


def test_kv_of_a_big_batch_does_not_fit():
    """160 sequences x 8K KV of 70 KB per token is 92 GB: over a 64 GB die."""
    cap = hbm_check(CM, R1, 160, 8192, 320, ep=320)
    assert cap.kv_gb == pytest.approx(160 * 8192 * 61 * 576 * 2 / 1e9)
    assert not cap.fits and "does not fit" in cap.message("decode")


def test_calibration_point_fits():
    """The paper's decode point (96 x 4K per die, EP320) fits in 64 GB."""
    assert hbm_check(CM, R1, 96, 4096, 192, ep=320).fits


def test_simulate_deployment_reports_instead_of_simulating(tmp_path, capsys):
    """A deployment whose decode does not fit prints fits=false and no TPOT; prefill is still predicted."""
    from tests.sim.test_paper_tables import main

    assert main(["simulate", "deployment", str(_write(tmp_path, PDC)), "--batch", "160", "--kv", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode"]["fits"] is False and "tpot_ms" not in out["decode"]
    assert out["prefill"]["fits"] and out["prefill"]["tokens_per_s_per_device"] > 0


def test_simulate_deployment_reproduces_the_calibration_point(tmp_path, capsys):
    """The paper's deployment as a file gives the same TPOT as the calibration point."""
    from tests.sim.test_paper_tables import main

    assert main(["simulate", "deployment", str(_write(tmp_path, PDC)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode"]["tpot_ms"] == pytest.approx(49.4, rel=0.005)
