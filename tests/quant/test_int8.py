"""The INT8 products: exact integer GEMM, and the W8A8 linear and expert methods against a
float reference (tolerance: 2 % relative Frobenius error for Gaussian data, where per-token
x per-channel int8 rounding gives about 0.5-1 %)."""

import torch
import torch.nn.functional as F

from matrixinfer.model.layers import ColumnParallelLinear, MergedColumnParallelLinear, RoutedExperts
from matrixinfer.quant import W8A8Config
from matrixinfer.quant.algorithms import fake_quant_activation
from matrixinfer.quant.int8 import int_mm, int8_linear, quantize_activation, quantize_weight

G = torch.Generator().manual_seed(0)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_int_mm_is_the_exact_integer_product():
    a = torch.randint(-127, 128, (5, 72), dtype=torch.int8, generator=G)
    b = torch.randint(-127, 128, (72, 24), dtype=torch.int8, generator=G)
    assert torch.equal(int_mm(a, b).long(), a.long() @ b.long())


def test_int8_linear_equals_the_quantized_math_and_is_close_to_float():
    x, w = torch.randn(7, 64, generator=G), torch.randn(48, 64, generator=G)
    wq, ws = quantize_weight(w)
    y = int8_linear(x, wq.t(), ws.t())
    quantized_ref = fake_quant_activation(x) @ (wq.float() * ws).t()  # same rounding, float product
    assert torch.allclose(y, quantized_ref, rtol=1e-5, atol=1e-5)
    assert rel(y, x @ w.t()) < 0.02


def test_per_token_scales_follow_each_row():
    x = torch.randn(4, 32, generator=G)
    x[1] *= 1000.0  # one loud token must not flatten the others
    q, s = quantize_activation(x)
    assert torch.allclose(q.float() * s, x, rtol=0, atol=(x.abs().amax(1, keepdim=True) / 254).max().item())
    assert rel(q[0].float() * s[0], x[0]) < 0.01


def _load_linear(layer, w, shard_ids=(None,)):
    """Feed a merged or plain layer int8 pieces + scales as a checkpoint would."""
    for sid, piece in zip(shard_ids, w.chunk(len(shard_ids))):
        q, s = quantize_weight(piece)
        layer.weight_loader(layer.weight, q, sid)
        layer.weight_scale.weight_loader(layer.weight_scale, s, sid)


def test_w8a8_linear_layer_loads_merged_pieces_and_multiplies_in_int8():
    cfg = W8A8Config()
    layer = MergedColumnParallelLinear(32, [16, 16], quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj",
                                       tp_rank=0, tp_size=1)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    w = torch.randn(32, 32, generator=G)
    _load_linear(layer, w, (0, 1))
    x = torch.randn(3, 32, generator=G)
    assert rel(layer(x), x @ w.t()) < 0.02


def test_per_tensor_checkpoint_scale_is_expanded_per_row():
    layer = ColumnParallelLinear(16, 8, quant_config=W8A8Config(), prefix="model.layers.0.self_attn.q_b_proj",
                                 tp_rank=0, tp_size=1)
    layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor([0.5]))
    assert torch.equal(layer.weight_scale, torch.full((8, 1), 0.5))


def test_ignored_and_absorbed_layers_stay_float():
    cfg = W8A8Config(ignore=["lm_head", r"re:.*mlp\.gate$"])
    head = ColumnParallelLinear(8, 8, quant_config=cfg, prefix="lm_head", tp_rank=0, tp_size=1)
    kv_b = ColumnParallelLinear(8, 8, quant_config=cfg, prefix="model.layers.0.self_attn.kv_b_proj",
                                tp_rank=0, tp_size=1)
    assert head.weight.dtype != torch.int8
    # kv_b_proj quantized by some other writer: loaded as int8, dequantized once for absorption
    w = torch.randn(8, 8, generator=G)
    _load_linear(kv_b, w)
    kv_b.quant_method.process_weights_after_loading(kv_b)
    assert kv_b.weight.dtype == torch.float32 and rel(kv_b.weight, w) < 0.01


def _w8a8_experts(e, h, i):
    """RoutedExperts under W8A8 loaded with random weights; returns (layer, float w13, float w2)."""
    layer = RoutedExperts(e, h, i, quant_config=W8A8Config(), prefix="model.layers.1.mlp.experts",
                          tp_rank=0, tp_size=1)
    w13, w2 = torch.randn(e, 2 * i, h, generator=G) / 4, torch.randn(e, h, i, generator=G) / 4
    for k in range(e):
        for piece, w in (("gate_proj", w13[k, :i]), ("up_proj", w13[k, i:]), ("down_proj", w2[k])):
            q, s = quantize_weight(w)
            name = "w2" if piece == "down_proj" else "w13"
            layer.weight_loader(getattr(layer, f"{name}_weight"), q, (k, piece))
            layer.weight_loader(getattr(layer, f"{name}_weight_scale"), s, (k, piece))
    return layer, w13, w2


def test_w8a8_pairs_path_equals_the_int8_gemm_path_and_needs_no_host_sync():
    """A small batch (2 * tokens * top_k <= experts) takes the pairs path, as the compiled decode
    step must (the grouped path reads expert counts on the host: a graph break, which had
    failed the compiled warm-up of every W8A8 checkpoint). Its outputs equal the per-expert
    int8 GEMM path exactly (inner sizes far below 2**24 / 127**2), and it traces whole."""
    layer, _, _ = _w8a8_experts(16, 32, 16)
    x = torch.randn(3, 32, generator=G)
    ids = torch.stack([torch.randperm(16, generator=G)[:2] for _ in range(3)])
    weights = torch.rand(3, 2, generator=G)
    assert layer.path(3, 2, x.device, x.dtype) == "pairs"
    want = layer(x, weights, ids, path="grouped")
    assert torch.equal(layer(x, weights, ids), want)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(x, weights, ids), want, rtol=1e-5, atol=1e-6)


def test_w8a8_experts_match_a_per_expert_float_reference():
    e, h, i = 4, 32, 16
    layer, w13, w2 = _w8a8_experts(e, h, i)
    x = torch.randn(10, h, generator=G)
    ids = torch.stack([torch.randperm(e, generator=G)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=G)
    y = layer(x, weights, ids)
    ref = torch.zeros_like(x)
    for t in range(10):
        for j in range(2):
            k = ids[t, j]
            gate, up = (x[t] @ w13[k].t()).chunk(2)
            ref[t] += weights[t, j] * (F.silu(gate) * up) @ w2[k].t()
    assert rel(y, ref) < 0.03  # two quantized products in a row
