"""Hardware and model files load into validated dataclasses."""

import json

import pytest
import yaml

from matrixinfer.sim.hardware import HARDWARE_DIR, SpecError, available_hardware, hardware_from_dict, load_hardware
from matrixinfer.sim.modelspec import load_model, model_from_config


def _cm384_raw():
    return yaml.safe_load((HARDWARE_DIR / "cloudmatrix384.yaml").read_text())


def test_every_bundled_hardware_file_loads():
    """All shipped systems (CloudMatrix384, H800, H100, the 8192 what-if) pass validation."""
    names = available_hardware()
    assert {"cloudmatrix384", "h800", "h100", "supernode8192"} <= set(names)
    for n in names:
        assert load_hardware(n).devices > 0


def test_cloudmatrix_die_numbers_match_spec_sheet():
    """A device is one 910C die: 376 BF16 TFLOPS, 1.6 TB/s, 7 x 224 Gbps = 196 GB/s UB."""
    hw = load_hardware("cloudmatrix384")
    assert hw.device.tflops["bf16"] == 376 and hw.device.tflops["int8"] == 752
    assert hw.device.hbm_tb_s == 1.6 and hw.device.hbm_gb == 64
    assert hw.scale_up.gb_s == pytest.approx(7 * 224 / 8)
    assert hw.devices == 384 * hw.device.per_package


def test_missing_field_is_named_in_the_error():
    """A hardware file without device.hbm_tb_s is rejected with the field's path in the message."""
    raw = _cm384_raw()
    del raw["device"]["hbm_tb_s"]
    with pytest.raises(SpecError, match="device: missing field 'hbm_tb_s'"):
        hardware_from_dict(raw, "x.yaml")


def test_efficiency_above_one_is_rejected():
    """Efficiencies are fractions of peak; 1.2 is an error, not a silently faster machine."""
    raw = _cm384_raw()
    raw["efficiency"]["mla_compute"] = 1.2
    with pytest.raises(SpecError, match="mla_compute"):
        hardware_from_dict(raw, "x.yaml")


def test_fp8_on_ascend_is_an_error():
    """The 910C has no FP8: asking for FP8 peak raises instead of guessing."""
    with pytest.raises(SpecError, match="no fp8"):
        load_hardware("cloudmatrix384").peak_flops("fp8")


def test_deepseek_r1_parameter_counts():
    """From config.json alone: 671 B total parameters (without MTP), ~37 B activated per token."""
    m = load_model("deepseek-r1")
    assert m.total_params() / 1e9 == pytest.approx(671.0, abs=1.0)
    assert m.activated_params_per_token() / 1e9 == pytest.approx(37, abs=1.0)
    assert (m.layers, m.moe_layers, m.kv_elems_per_token_layer()) == (61, 58, 576)


def test_reads_any_config_json(tmp_path):
    """A Llama-style dense GQA config (no MLA, no experts) is read from a directory path."""
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
           "intermediate_size": 14336, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(tmp_path)
    assert not m.is_mla and m.routed_experts == 0 and m.moe_layers == 0
    assert m.kv_elems_per_token_layer() == 2 * 8 * 128
    assert 7.0e9 < m.total_params() < 8.5e9  # Llama-3-8B


def test_bad_top_k_is_rejected():
    """num_experts_per_tok larger than the expert count is an error."""
    with pytest.raises(SpecError, match="num_experts_per_tok"):
        model_from_config({"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
                           "intermediate_size": 16, "vocab_size": 10, "n_routed_experts": 4,
                           "num_experts_per_tok": 5}, "bad")


def test_deepseek_v2_lite_config_without_q_lora():
    """DeepSeek-V2-Lite's config (q_lora_rank null, 64 experts top-6, 2 shared): 15.7 B total,
    2.4 B activated, as its model card says."""
    cfg = dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, intermediate_size=10944,
               moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
               first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400)
    m = model_from_config(cfg, "v2-lite")
    assert m.q_lora_rank == 0 and m.mtp_layers == 0
    assert m.total_params() / 1e9 == pytest.approx(15.7, abs=0.1)
    assert m.activated_params_per_token() / 1e9 == pytest.approx(2.4, abs=0.1)


def test_every_constant_of_the_bundled_files_names_its_source():
    """Each number in a bundled hardware YAML has a `sources:` entry of a known kind."""
    from matrixinfer.sim.hardware import SOURCE_KINDS, numeric_fields

    for path in HARDWARE_DIR.glob("*.yaml"):
        raw = yaml.safe_load(path.read_text())
        hw = load_hardware(path)
        missing = set(numeric_fields(raw)) - set(hw.sources)
        assert not missing, (path.name, sorted(missing))
        assert all(v.startswith(SOURCE_KINDS) for v in hw.sources.values())


def test_source_of_an_unknown_field_is_rejected():
    """A typo in `sources:` names the field instead of silently documenting nothing."""
    raw = _cm384_raw()
    raw["sources"]["efficiency.overlapp"] = "fitted to x"
    with pytest.raises(SpecError, match="overlapp"):
        hardware_from_dict(raw, "x.yaml")
