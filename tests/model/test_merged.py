"""Merged projections and stacked experts compute what the checkpoint's separate tensors
compute with plain matmuls, in both grouped-expert strategies, and for an expert subset."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from matrixinfer.model.loader import load_model
from tests.hf_fixtures import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("merged")
    make_checkpoint(path, "v3-qlora-yarn")
    return path, load_file(str(path / "model.safetensors")), load_model(path, dtype="float32")


def swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def test_merged_gate_up_equals_separate_projections(ckpt):
    _, sd, model = ckpt
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    p = "model.layers.0.mlp"
    with torch.no_grad():
        ours = model.model.layers[0].mlp(x)
    ref = swiglu(x, sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"], sd[f"{p}.down_proj.weight"])
    assert torch.allclose(ours, ref, atol=1e-5)


def test_merged_latent_projection_equals_q_a_and_kv_a(ckpt):
    _, sd, model = ckpt
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    p = "model.layers.1.self_attn"
    with torch.no_grad():
        q_a, kv_a = model.model.layers[1].self_attn.fused_qkv_a_proj(x).split([24, 24], dim=-1)
    assert torch.allclose(q_a, F.linear(x, sd[f"{p}.q_a_proj.weight"]), atol=1e-6)
    assert torch.allclose(kv_a, F.linear(x, sd[f"{p}.kv_a_proj_with_mqa.weight"]), atol=1e-6)


@pytest.mark.parametrize("n_tokens", [3, 40])  # few tokens: padded bmm; many, skewed: expert by expert
def test_stacked_experts_equal_one_mlp_per_expert(ckpt, n_tokens):
    _, sd, model = ckpt
    moe = model.model.layers[2].mlp
    x = torch.randn(n_tokens, 32, generator=torch.Generator().manual_seed(n_tokens))
    with torch.no_grad():
        weights, ids = moe.gate(x)
        ours = moe.experts(x, weights, ids)
    p = "model.layers.2.mlp.experts"
    ref = torch.zeros_like(x)
    for t in range(n_tokens):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            ref[t] += w * swiglu(x[t], sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"],
                                 sd[f"{p}.{e}.down_proj.weight"])
    assert torch.allclose(ours, ref, atol=1e-5)


def test_expert_subset_computes_only_its_pairs(ckpt):
    """Summing the local outputs of two disjoint expert subsets gives the full routed output."""
    path, _, model = ckpt
    full = model.model.layers[2].mlp
    half_a = load_model(path, dtype="float32", expert_ids=[0, 2, 4, 6]).model.layers[2].mlp
    half_b = load_model(path, dtype="float32", expert_ids=[1, 3, 5, 7]).model.layers[2].mlp
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w, ids = full.gate(x)
        total = full.experts(x, w, ids)
        parts = half_a.experts(x, w, ids) + half_b.experts(x, w, ids)
    assert torch.allclose(total, parts, atol=1e-5)
