"""The shipped model (models/matrixinfer-tiny-moe): small, DeepSeek-V3 shaped, loaded alike
by transformers and matrixinfer, and better than a unigram model on held-out files."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from matrixinfer.model.loader import load_model

MODEL = Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe"
PROMPT = "class Stack:\n    def __init__(self):"


@pytest.fixture(scope="module")
def ours():
    torch.set_num_threads(2)
    return load_model(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def test_checkpoint_is_under_25_mb_with_10_to_20_million_parameters():
    assert (MODEL / "model.safetensors").stat().st_size < 25_000_000
    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        n = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert 8_000_000 < n < 20_000_000


def test_config_is_deepseek_v3_at_small_scale():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["q_lora_rank"] and cfg["kv_lora_rank"]
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_hidden_layers"] >= 2
    assert cfg["n_routed_experts"] >= 8 and cfg["num_experts_per_tok"] >= 2 and cfg["n_shared_experts"] == 1
    assert cfg["n_group"] > 1 and cfg["num_nextn_predict_layers"] == 1


def test_mtp_weights_are_stored_under_layer_num_hidden_layers():
    cfg = json.loads((MODEL / "config.json").read_text())
    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        L = cfg["num_hidden_layers"]
        for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                     "embed_tokens.weight", "shared_head.head.weight", "mlp.gate.e_score_correction_bias"):
            assert f"model.layers.{L}.{name}" in keys
        assert not any(k.startswith(f"model.layers.{L + 1}.") for k in keys)
        # the correction bias was learned, not left at zero
        assert f.get_tensor(f"model.layers.{L - 1}.mlp.gate.e_score_correction_bias").abs().sum() > 0


def test_matrixinfer_loads_the_mtp_module(ours):
    assert len(ours.model.mtp) == 1


def test_transformers_and_matrixinfer_give_the_same_greedy_continuation(ours, tokenizer):
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                             do_sample=False)[0, ids.shape[1]:].tolist()
        x, mine = ids, []
        for _ in range(32):
            nxt = int(ours.compute_logits(ours(x, torch.arange(x.shape[1])[None]))[0, -1].argmax())
            mine.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    assert mine == theirs


def test_the_model_card_reports_perplexity_far_below_unigram():
    ev = json.loads((MODEL / "eval.json").read_text())
    assert ev["perplexity"] < ev["unigram_perplexity"] / 5
    assert 0 < ev["mtp_top1"] < 1 and ev["greedy_match"]
    card = (MODEL / "README.md").read_text()
    assert f'{ev["perplexity"]:.2f}' in card and f'{ev["unigram_perplexity"]:.1f}' in card
    assert (MODEL / "training_curve.png").exists()
