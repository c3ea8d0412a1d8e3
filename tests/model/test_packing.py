"""Inference packing (fused x-projections, stacked experts) computes what the plain modules
compute, in both grouped-expert strategies, and for an expert subset."""

import copy

import pytest
import torch

from matrixinfer.model.loader import load_model
from matrixinfer.model.moe import MoE
from tests.hf_fixtures import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("pack")
    make_checkpoint(path, "v3-qlora-yarn")
    return path


def unpacked(model):
    """A deep copy with every packed tensor dropped: the per-module reference path."""
    plain = copy.deepcopy(model)
    for m in plain.modules():
        for attr in ("x_proj", "gate_up", "w13", "w2"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)
    return plain


@pytest.mark.parametrize("n_tokens", [3, 40])  # few tokens: padded bmm; many, skewed: expert by expert
def test_packed_model_equals_plain_modules(ckpt, n_tokens):
    model = load_model(ckpt, dtype="float32")
    assert model.model.layers[1].mlp.w13 is not None
    ids = torch.randint(0, 97, (2, n_tokens), generator=torch.Generator().manual_seed(n_tokens))
    pos = torch.arange(n_tokens).expand(2, n_tokens)
    with torch.no_grad():
        a = model.compute_logits(model(ids, pos))
        b = unpacked(model).compute_logits(unpacked(model)(ids, pos))
    assert torch.allclose(a, b, atol=1e-5)


def test_packed_parameters_are_views(ckpt):
    """Packing adds no memory: expert weights live inside the stacked tensors."""
    moe = load_model(ckpt, dtype="float32").model.layers[1].mlp
    assert isinstance(moe, MoE)
    up = moe.experts["3"].up_proj.weight
    assert up.data_ptr() == moe.w13[3, up.shape[0]:].data_ptr()


def test_expert_subset_computes_only_its_pairs(ckpt):
    """Summing the local outputs of two disjoint expert subsets gives the full routed output."""
    full = load_model(ckpt, dtype="float32").model.layers[2].mlp
    half_a = load_model(ckpt, dtype="float32", expert_ids=[0, 2, 4, 6]).model.layers[2].mlp
    half_b = load_model(ckpt, dtype="float32", expert_ids=[1, 3, 5, 7]).model.layers[2].mlp
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w, ids = full.gate(x)
        total = full.forward_local(x, w, ids)
        parts = half_a.forward_local(x, w, ids) + half_b.forward_local(x, w, ids)
    assert torch.allclose(total, parts, atol=1e-5)
