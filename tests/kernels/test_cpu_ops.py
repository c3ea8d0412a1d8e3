"""The paged MLA decode kernel (kernels/cpu_ops.cpp) against the PyTorch path it
replaces: gather the latents through the block table, then MLAttention._attend_absorbed."""

import pytest
import torch

from matrixinfer.config import ModelConfig
import matrixinfer.kernels as kernels
from matrixinfer.kernels import load_cpu_ops, paged_mla_decode
from matrixinfer.model.attention import MLAttention
from matrixinfer.model.context import ForwardContext, forward_context

pytestmark = pytest.mark.skipif(not load_cpu_ops(), reason="no C++ compiler to build the operators")


def _case(dtype, seqs=5, heads=4, rank=64, rope=16, block_size=4, blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(blocks, block_size, rank + rope, generator=g).to(dtype)
    lens = torch.randint(1, 40, (seqs,), generator=g)
    lens[0] = 1  # a sequence with only its own token
    width = int(-(-lens.max() // block_size)) + 1  # one spare column, as the runner pads
    tables = torch.randperm(blocks, generator=g)[: seqs * width].view(seqs, width)
    q = torch.randn(seqs, heads, rank + rope, generator=g).to(dtype)
    return q, cache, tables, lens


def _reference(q, cache, tables, lens, scale, rank):
    latents = cache[tables].flatten(1, 2).float()
    scores = torch.bmm(q.float(), latents.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.arange(latents.shape[1])[None, None] >= lens[:, None, None], float("-inf"))
    return torch.bmm(scores.softmax(-1), latents[..., :rank])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_gathered_attention(dtype, tol):
    """Every sequence attends exactly its first context_lens latents, wherever the table puts
    them: float32 to 1e-5; bfloat16 inputs within bf16 rounding of the output (the kernel
    accumulates in float32)."""
    q, cache, tables, lens = _case(dtype)
    out = paged_mla_decode(q, cache, tables, lens, 0.17, 64)
    assert out.shape == (5, 4, 64) and out.dtype == dtype
    ref = _reference(q, cache, tables, lens, 0.17, 64)
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol), (out.float() - ref).abs().max()
    # a column slice of the table (the mixed-step path passes one) reads the same blocks
    assert torch.equal(paged_mla_decode(q, cache, tables[:, :-1], lens, 0.17, 64), out)


def test_attention_layer_same_output_with_and_without_the_kernel(monkeypatch):
    """A decode-only step through MLAttention (the absorbed path: query absorption, kernel,
    output up-projection) equals the gathering path in float32, 1e-5, on a DeepSeek-V3 shaped layer."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    _, cache, tables, lens = _case(torch.float32, rank=32, rope=8)
    attn.kv_cache = cache
    x = torch.randn(5, 64)
    pos = lens - 1
    slots = tables.gather(1, (pos // 4)[:, None])[:, 0] * 4 + pos % 4
    ctx = ForwardContext([], [], slots, tables, 5, lens, decode_only=True)
    rope = attn.rotary.cos_sin(pos, x.dtype)
    with torch.inference_mode(), forward_context(ctx):
        with_kernel = attn(x, rope)
        monkeypatch.setattr(kernels, "_loaded", False)
        without = attn(x, rope)
    assert torch.allclose(with_kernel, without, rtol=1e-5, atol=1e-5), (with_kernel - without).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_per_expert_matmuls_also_compiled(dtype):
    """Rows grouped by expert (an empty group included) times their experts' matrices, eager
    and inside torch.compile (whose own shape rule for ATen's grouped matmul takes bfloat16 only)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    a = torch.randn(int(counts.sum()), 16, generator=g).to(dtype)
    b = torch.randn(4, 16, 8, generator=g).to(dtype)
    offs = counts.cumsum(0).to(torch.int32)
    ref = torch.cat([rows.float() @ b[e].float() for e, rows in enumerate(a.split(counts.tolist()))])
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(kernels.grouped_mm(a, b, offs).float(), ref, rtol=tol, atol=tol)
    compiled = torch.compile(kernels.grouped_mm, fullgraph=True, dynamic=False)
    assert torch.allclose(compiled(a, b, offs).float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("width", [1, 15, 16, 64, 100, 4096])
def test_argmax_rows_equals_torch_argmax(width):
    """The first index of each row's maximum, as torch.argmax answers: random rows of widths
    around the 16-lane vectors and 64-wide chunks, ties (the first one wins, wherever it lies),
    a row of -inf only (0) and rows partly masked to -inf, as sampling masks tokens."""
    from matrixinfer.kernels import argmax_rows

    g = torch.Generator().manual_seed(width)
    x = torch.randn(40, width, generator=g)
    x[1] = float("-inf")
    x[2, : width // 2] = float("-inf")
    if width > 3:
        x[3, [width - 1, width // 3, 2]] = 9.0  # a three-way tie: index 2 wins
        x[4, [width - 1, width - 2]] = 9.0
    x[5] = 0.0  # all equal: index 0
    got = torch.ops.matrixinfer.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, :width]), x.argmax(dim=-1))  # and the helper's path
    assert torch.equal(argmax_rows(x.double()), x.argmax(dim=-1))  # other dtypes: torch.argmax
