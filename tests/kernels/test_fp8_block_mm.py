"""kernels.fp8_block_mm (the C++ operator: FP8 weights dequantized per 128 x 128 block inside the
product) against its PyTorch reference, and the reference's dequantization against a plain
loop over blocks: ragged edge blocks, merged pieces not on block edges, shards starting inside
a block, many experts, both row-count regimes, float32 and bfloat16."""

import pytest
import torch

from matrixinfer.kernels import fp8_block_dequant, fp8_block_mm, fp8_block_mm_reference, load_cpu_ops

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def operators():
    if not load_cpu_ops():
        pytest.skip("the CPU operators did not build here")


def weights(*shape, blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(FP8)
    return w, torch.rand(*shape[:-2], *blocks, generator=g) * 0.02 + 0.001


def loop_dequant(w, scale, row_block, k_shift, block_k):
    """The definition, one element at a time (small shapes only)."""
    out = torch.empty(w.shape)
    for n in range(w.shape[0]):
        for k in range(w.shape[1]):
            out[n, k] = w[n, k].float() * scale[row_block[n], (k + k_shift) // block_k]
    return out


def test_reference_dequant_is_the_block_definition():
    """Rows of two merged pieces (130 rows then 70, each on its own block grid: scale rows 0-1
    and 2) and columns shifted 100 into the grid (an input shard starting mid-block)."""
    w, scale = weights(200, 60, blocks=(3, 2))
    row_block = torch.cat([torch.arange(130) // 128, 2 + torch.arange(70) // 128]).int()
    got = fp8_block_dequant(w, scale, row_block, k_shift=100, block_k=128)
    assert torch.equal(got, loop_dequant(w, scale, row_block, 100, 128))


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])  # <= 16: fused dequantize-and-dot; more: chunked GEMMs
@pytest.mark.parametrize("n, k, k_shift", [(200, 300, 0), (128, 128, 0), (300, 130, 64), (5, 7, 0)])
def test_linear_float32_matches_reference(rows, n, k, k_shift):
    w, scale = weights(n, k, blocks=(-(-n // 128), -(-(k + k_shift) // 128)), seed=rows)
    row_block = (torch.arange(n) // 128).int()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    got = fp8_block_mm(x, w, scale, row_block, k_shift, 128)
    ref = fp8_block_mm_reference(x, w, scale, row_block, k_shift, 128)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 90])
def test_experts_match_reference_per_row(dtype, rows):
    """Rows in any order, each times its expert's matrix (expert 2 of 4 gets none); bfloat16
    rows: the product in float32, rounded once, so within bfloat16's rounding of the float32
    reference on the same (bfloat16) inputs."""
    w, scale = weights(4, 144, 160, blocks=(2, 2))
    row_block = (torch.arange(144) // 128).int()
    g = torch.Generator().manual_seed(rows)
    experts = torch.tensor([0, 1, 3])[torch.randint(0, 3, (rows,), generator=g)]
    x = torch.randn(rows, 160, generator=g).to(dtype)
    got = fp8_block_mm(x, w, scale, row_block, 0, 128, experts)
    ref = torch.stack([fp8_block_dequant(w[e], scale[e], row_block) @ x[p].float() for p, e in enumerate(experts)])
    assert got.dtype == dtype
    fallback = fp8_block_mm_reference(x.float(), w, scale, row_block, 0, 128, experts)  # the path without operators
    assert (fallback - ref).abs().max() <= 1e-6 * ref.abs().max()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert ((got.float() - ref).abs() <= tol * ref.abs() + 1e-6 * ref.abs().max()).all()


def test_operator_refuses_a_scale_grid_that_does_not_cover_the_weight():
    w, scale = weights(130, 200, blocks=(2, 1))  # 200 columns need 2 column blocks
    with pytest.raises(RuntimeError, match="does not cover"):
        fp8_block_mm(torch.randn(1, 200), w, scale, (torch.arange(130) // 128).int(), 0, 128)


def test_every_finite_e4m3_byte_dequantizes_as_torch_converts_it():
    """The operator decodes e4m3fn on the bits: all 254 finite values (subnormals, both zeros,
    +-448) times a scale of 1, as one row each of an identity product."""
    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8).view(FP8)
    w = finite[:, None].expand(-1, 1).contiguous()  # [254, 1]: row n holds byte n
    got = fp8_block_mm(torch.ones(1, 1), w, torch.ones(2, 1), (torch.arange(254) // 128).int(), 0, 128)
    assert torch.equal(got[0], finite.float())
