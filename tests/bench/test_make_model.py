"""`matrixinfer bench make-model`: the shape table gives the released models' parameter counts
(counted on the meta device from the tensors the loader expects: no memory), and the writer's
checkpoints, on scaled-down shapes, load (sharded, bf16 or the FP8 release format) with
activations in a sane range."""

import math

import pytest
import torch

from matrixinfer.bench.make_model import checkpoint_shapes, hf_config, write_model
from matrixinfer.model.loader import load_model

# the real shapes' widths scaled down (the rest of each config, routing included, as released)
SMALL = dict(vocab_size=512, hidden_size=192, intermediate_size=384, moe_intermediate_size=160,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64)


def parameters(shape, layers):
    return sum(math.prod(s) for _, s in checkpoint_shapes(hf_config(shape, layers)))


@pytest.mark.parametrize("shape, layers, released", [
    ("deepseek-v3", 61, 671.0e9),  # DeepSeek-V3 / R1 without the MTP module: 671B
    ("deepseek-v2-lite", 27, 15.7e9),  # DeepSeek-V2-Lite: 15.7B
    ("deepseek-v2-lite", 6, 3.4e9),  # issue 56's 6-layer cut
])
def test_shape_table_gives_the_released_parameter_counts(shape, layers, released):
    assert abs(parameters(shape, layers) / released - 1) < 0.01


def test_a_cut_model_keeps_a_moe_layer():
    cfg = hf_config("deepseek-v3", 2)
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_routed_experts"] == 256 and cfg["num_nextn_predict_layers"] == 0


def forward(model, n=48):
    """(RMS of the residual stream entering the final norm, std of the logits)."""
    seen = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(n)[None])).float()
    hook.remove()
    return seen["x"].float().pow(2).mean().sqrt().item(), logits.std().item(), logits


def test_written_checkpoint_loads_sharded_with_sane_activations(tmp_path):
    summary = write_model(tmp_path, "deepseek-v2-lite", 3, shard_gb=0.002, **SMALL)
    assert summary["shards"] > 1 and (tmp_path / "model.safetensors.index.json").exists()
    model = load_model(tmp_path, dtype="float32")
    assert model.model.layers[2].mlp.experts.w13_weight.shape[0] == 64  # the real expert count
    rms, std, _ = forward(model)
    assert 0.3 < rms < 10 and 0.3 < std < 3


def test_fp8_written_checkpoint_runs_like_its_dequantized_weights(tmp_path):
    write_model(tmp_path, "deepseek-v3", 2, fp8=True, q_lora_rank=96, n_routed_experts=16, n_group=4, topk_group=2,
                **SMALL)
    kept = load_model(tmp_path, dtype="float32", keep_fp8=True)
    assert kept.model.layers[1].mlp.experts.w2_weight.dtype == torch.float8_e4m3fn
    rms, std, got = forward(kept)
    _, _, ref = forward(load_model(tmp_path, dtype="float32"))
    assert 0.3 < rms < 10 and 0.3 < std < 3
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
