"""The paged MLA decode kernel (kernels/cpu_ops.cpp) against the PyTorch path it
replaces: gather the latents through the block table, then MLAttention._attend_absorbed."""

import pytest
import torch
import torch.nn.functional as F

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


@pytest.mark.parametrize("block_size, heads", [(4, 4), (16, 4), (32, 3)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_equals_gathered_attention(dtype, tol, block_size, heads):
    """Every sequence attends exactly its first context_lens latents, wherever the table puts
    them: float32 to 1e-5; bfloat16 inputs within bf16 rounding of the output (the kernel
    accumulates in float32). Blocks of 16 and 32 rows take the 16-row score tiles (AVX-512),
    their partial last blocks the row-at-a-time path."""
    q, cache, tables, lens = _case(dtype, heads=heads, block_size=block_size)
    out = paged_mla_decode(q, cache, tables, lens, 0.17, 64)
    assert out.shape == (5, heads, 64) and out.dtype == dtype
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
    a row of -inf only (0), rows partly masked to -inf, as sampling masks tokens, and NaNs
    (the first NaN wins, as in torch)."""
    from matrixinfer.kernels import argmax_rows

    g = torch.Generator().manual_seed(width)
    x = torch.randn(40, width, generator=g)
    x[1] = float("-inf")
    x[2, : width // 2] = float("-inf")
    if width > 3:
        x[3, [width - 1, width // 3, 2]] = 9.0  # a three-way tie: index 2 wins
        x[4, [width - 1, width - 2]] = 9.0
    x[5] = 0.0  # all equal: index 0
    x[6, width // 2] = float("nan")
    x[7, [width - 1, 0]] = float("nan")
    x[8, :] = float("inf")
    x[8, width - 1] = float("nan")
    got = torch.ops.matrixinfer.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, :width]), x.argmax(dim=-1))  # and the helper's path
    assert torch.equal(argmax_rows(x.double()), x.argmax(dim=-1))  # other dtypes: torch.argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(256, 384), (78, 48), (64, 16)])
def test_small_mm_equals_linear_per_row(dtype, k, n):
    """Each row times its expert's packed matrix, as F.linear computes it in float32 from the
    same inputs: rows in any order, experts with one to nine rows (tiles of four, two, one) and
    one with none, K off the vector sizes, N of 1, 3 and 24 blocks of 16 (passes of four blocks
    and the rest), and the dense form (one matrix, no expert ids) at 3 and 17 rows. float32 to
    1e-5; bfloat16 within the rounding of its output (float32 accumulation). pack_small_mm
    declines what the operator cannot take (N off the block, an odd K in bfloat16)."""
    from matrixinfer.kernels import pack_small_mm, small_mm, small_mm_serves

    if not small_mm_serves(dtype, torch.device("cpu")):
        pytest.skip(f"this CPU's build has no small_mm for {dtype}")
    g = torch.Generator().manual_seed(k)
    w = torch.randn(5, n, k, generator=g).to(dtype)
    experts = torch.tensor([3, 0, 3, 1, 3, 0] + [4] * 9 + [1, 3])[torch.randperm(17, generator=g)]  # expert 2: none
    x = torch.randn(17, k, generator=g).to(dtype)
    ref = torch.stack([F.linear(x[p].float(), w[e].float()) for p, e in enumerate(experts.tolist())])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = small_mm(x, pack_small_mm(w), experts)
    assert got.dtype == dtype and got.shape == (17, n)
    assert ((got.float() - ref).abs().max() / ref.abs().max()) < tol
    for rows in (3, 17):  # a decode step's few rows, and past a tile of eight (float32 on AMD runs up to 32)
        dense = small_mm(x[:rows], pack_small_mm(w[4]))
        assert ((dense.float() - F.linear(x[:rows].float(), w[4].float())).abs().max() / ref.abs().max()) < tol
    with pytest.raises(RuntimeError, match="names expert"):
        small_mm(x, pack_small_mm(w), torch.full((17,), 5))
    assert pack_small_mm(w[:, :n - 1]) is None
    assert (pack_small_mm(w[..., :k - 1]) is None) == (dtype == torch.bfloat16)


def test_absorbed_copies_give_the_same_attention_in_bfloat16():
    """MLAttention's decode with W_UK^T / W_UV copied for the few-rows operator
    (prepare_absorbed) equals the einsums over kv_b_proj's views, within bfloat16 rounding,
    for one query per sequence and for speculative verification's folded queries."""
    from matrixinfer.kernels import small_mm_serves

    if not small_mm_serves(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU's build has no bfloat16 small_mm")
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    torch.manual_seed(0)
    attn = MLAttention(cfg, 0).to(torch.bfloat16)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(1)
    q_nope, q_pe = torch.randn(5, 4, 16, generator=g).bfloat16(), torch.randn(5, 4, 8, generator=g).bfloat16()
    latents, lens = torch.randn(5, 12, 40, generator=g).bfloat16(), torch.tensor([1, 12, 5, 7, 3])
    folded = (q_nope.view(5, 1, 4, 16).expand(5, 2, 4, 16), q_pe.view(5, 1, 4, 8).expand(5, 2, 4, 8),
              latents, torch.stack([lens, lens.clamp(max=4)], 1))
    with torch.inference_mode():
        views = attn._attend_absorbed(q_nope, q_pe, latents, lens), attn._attend_absorbed(*folded)
        attn.prepare_absorbed()
        assert attn.absorbed is not None
        copies = attn._attend_absorbed(q_nope, q_pe, latents, lens), attn._attend_absorbed(*folded)
    for a, b in zip(views, copies):
        assert a.shape == b.shape and ((a.float() - b.float()).abs().max() / a.float().abs().max()) < 2e-2


def test_compiled_steps_with_the_c_shims_are_served_from_inductors_cache(tmp_path, monkeypatch):
    """A graph compiled with the engine's options (the operators' C shims among them) is saved
    to inductor's FX-graph cache and, compiled again after Dynamo forgets it (an engine
    restart), loaded from there instead of generated: the shims option keys the cache by the
    operators' names. Before, an OpOverload in the option made every compile bypass the cache
    (each engine start paid full code generation)."""
    from torch._dynamo.utils import counters

    from matrixinfer.worker.compiled_decode import compile_options

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    a, b, offs = torch.randn(6, 16, generator=g), torch.randn(2, 16, 8, generator=g), torch.tensor([2, 6], dtype=torch.int32)

    def step(a, b, offs):
        return kernels.grouped_mm(a.relu(), b, offs) * 2

    want = step(a, b, offs)
    for attempt in ("miss", "hit"):
        torch._dynamo.reset()
        counters.clear()
        got = torch.compile(step, dynamic=False, options=compile_options())(a, b, offs)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert counters["inductor"][f"fxgraph_cache_{attempt}"] == 1, dict(counters["inductor"])
