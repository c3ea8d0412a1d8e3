"""Each offline technique's math on small tensors against a float reference."""

import torch

from matrixinfer.quant.algorithms import (
    fake_quant_activation,
    gptq_quantize,
    output_error,
    search_alpha,
    search_clip,
    smooth_factors,
)
from matrixinfer.quant.int8 import quantize_symmetric, weight_scales

G = torch.Generator().manual_seed(0)


def outlier_inputs(n=256, i=64, channels=(3, 17, 40), factor=100.0):
    x = torch.randn(n, i, generator=G)
    x[:, list(channels)] *= factor  # a few channels x100, as LLM activations have
    return x


def rtn_error(x, w, act="token"):
    scale = weight_scales(w)
    return output_error(x, w, quantize_symmetric(w, scale).float() * scale, act).sum()


def test_smoothing_keeps_the_float_product_and_cuts_int8_error_on_outlier_channels():
    x, w = outlier_inputs(), torch.randn(32, 64, generator=G)
    s = smooth_factors(x.abs().amax(0), w.abs().amax(0), 0.5)
    assert torch.allclose((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-4, atol=1e-3)
    assert rtn_error(x / s, w * s) < rtn_error(x, w) / 5


def test_alpha_zero_is_no_smoothing():
    assert torch.equal(smooth_factors(torch.rand(8) + 1, torch.rand(8) + 1, 0.0), torch.ones(8))


def test_alpha_search_smooths_outliers_and_leaves_flat_inputs_alone_enough():
    x, w = outlier_inputs(), torch.randn(32, 64, generator=G)
    assert search_alpha([w], x, x.abs().amax(0)) >= 0.4
    flat = torch.randn(256, 64, generator=G)
    a = search_alpha([w], flat, flat.abs().amax(0))
    s = smooth_factors(flat.abs().amax(0), w.abs().amax(0), a)
    assert rtn_error(flat / s, w * s) <= rtn_error(flat, w)  # the grid holds alpha 0: never worse


def test_clip_search_clips_heavy_tailed_rows_and_lowers_the_error():
    torch.manual_seed(0)
    w = torch.distributions.Laplace(0.0, 1.0).sample((32, 256))
    w[:, 0] *= 8.0  # one long-tailed input column per row
    x = torch.randn(512, 256, generator=G)
    x[:, 0] *= 0.01  # ... that the inputs barely use: clipping it costs little, resolution gains
    clip = search_clip(w, x)
    assert (clip < 1).float().mean() > 0.25
    scale = weight_scales(w, "channel", clip)
    searched = output_error(x, w, quantize_symmetric(w, scale).float() * scale).sum()
    assert searched < 0.8 * rtn_error(x, w)


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    base = torch.randn(1024, 16, generator=G)
    x = base @ torch.randn(16, 96, generator=G) + 0.1 * torch.randn(1024, 96, generator=G)  # low-rank + noise
    w = torch.randn(48, 96, generator=G)
    scale = weight_scales(w)
    rtn = quantize_symmetric(w, scale).float() * scale
    q = gptq_quantize(w, x.t() @ x, scale, block=32).float() * scale
    err = lambda wq: ((x @ w.t() - x @ wq.t()) ** 2).sum()  # noqa: E731
    assert err(q) < 0.5 * err(rtn)
    assert ((q - w).abs() <= scale * 127 + 1e-6).all()  # still on the per-channel grid, in range


def test_gptq_keeps_weights_already_on_the_grid():
    scale = torch.full((8, 1), 0.05)
    codes = torch.randint(-120, 121, (8, 40), generator=G).to(torch.int8)
    x = torch.randn(100, 40, generator=G)
    assert torch.equal(gptq_quantize(codes.float() * scale, x.t() @ x, scale, block=16), codes)


def test_fake_quant_per_tensor_is_worse_than_per_token_on_loud_tokens():
    x = torch.randn(64, 32, generator=G)
    x[::8] *= 50.0
    tok = (fake_quant_activation(x, "token") - x).norm()
    ten = (fake_quant_activation(x, "tensor") - x).norm()
    assert tok < ten / 3
