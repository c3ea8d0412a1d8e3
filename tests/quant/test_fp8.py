"""quant/fp8.py at the layer level: the release's quantization (quantize_tensor) round trip, a
tensor-parallel shard that starts inside a block (its rows and columns of the full dequantized
weight, merged pieces included), and clear errors for FP8 variants the engine does not run."""

import pytest
import torch

from matrixinfer.kernels import fp8_block_dequant
from matrixinfer.model.layers import MergedColumnParallelLinear, RowParallelLinear
from matrixinfer.quant.fp8 import Fp8LinearMethod, config_from_dict, dequantize_tensor, quantize_tensor

G = torch.Generator().manual_seed(0)


def test_quantize_tensor_is_the_release_block_scheme():
    """Each 128 x 128 block's max |w| maps to 448 (e4m3's largest), ragged edges included, and
    dequantizing gives w back within e4m3's relative step (2**-3) of each block's largest value."""
    w = torch.randn(300, 130, generator=G)
    q, scale = quantize_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert scale[2, 1] == w[256:, 128:].abs().max() / 448
    back = dequantize_tensor(q, scale, (128, 128), torch.float32)
    block_max = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :130] * 448
    assert ((back - w).abs() <= block_max * 2 ** -4).all()


def load_full(layer, pieces):
    """Load full checkpoint tensors (one (q, scale) per merged piece) into this rank's layer."""
    for i, (q, scale) in enumerate(pieces):
        shard = i if len(pieces) > 1 else None
        layer.weight.weight_loader(layer.weight, q, shard)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, shard)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_shard_of_merged_pieces_multiplies_like_its_rows_of_the_full_weight(rank):
    """gate | up of 272 rows each over 2 ranks: rank 1's rows start at 136, inside block 1."""
    pieces = [quantize_tensor(torch.randn(272, 160, generator=G)) for _ in range(2)]
    cfg = config_from_dict({"quant_method": "fp8", "weight_block_size": [128, 128]}, ["m.gate_proj.weight_scale_inv",
                                                                                      "m.up_proj.weight_scale_inv"])
    layer = MergedColumnParallelLinear(160, [272, 272], quant_config=cfg, prefix="m.gate_up_proj",
                                       tp_rank=rank, tp_size=2)
    assert isinstance(layer.quant_method, Fp8LinearMethod)
    load_full(layer, pieces)
    full = [dequantize_tensor(q, s, (128, 128), torch.float32) for q, s in pieces]
    want = torch.cat([f[rank * 136:(rank + 1) * 136] for f in full])
    x = torch.randn(3, 160, generator=G)
    got = layer.quant_method.apply(layer, x)
    assert (got - x @ want.T).abs().max() <= 1e-6 * (x @ want.T).abs().max()


def test_row_shard_starting_mid_block_multiplies_like_its_columns():
    """An input-split shard: rank 1 of 2 holds columns 100-199, which start inside block 0."""
    q, s = quantize_tensor(torch.randn(140, 200, generator=G))
    cfg = config_from_dict({"quant_method": "fp8", "weight_block_size": [128, 128]}, ["o.weight_scale_inv"])
    layer = RowParallelLinear(200, 140, quant_config=cfg, prefix="o", tp_rank=1, tp_size=2)
    load_full(layer, [(q, s)])
    assert layer.fp8_k_shift == 100
    want = dequantize_tensor(q, s, (128, 128), torch.float32)[:, 100:]
    assert torch.equal(fp8_block_dequant(layer.weight, layer.weight_scale_inv, layer.fp8_row_block, 100), want)


def test_wrong_scale_grid_is_a_clear_error():
    q, s = quantize_tensor(torch.randn(140, 200, generator=G))
    cfg = config_from_dict({"quant_method": "fp8", "weight_block_size": [128, 128]}, ["o.weight_scale_inv"])
    layer = RowParallelLinear(200, 140, quant_config=cfg, prefix="o", tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"block scale shape \(2, 1\) != \(2, 2\)"):
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s[:, :1])


@pytest.mark.parametrize("qcfg, match", [
    ({"fmt": "e5m2", "weight_block_size": [128, 128]}, "only e4m3"),
    ({"activation_scheme": "static", "weight_block_size": [128, 128]}, "only dynamic"),
    ({}, "weight_block_size"),
])
def test_unsupported_fp8_variants_are_clear_errors(qcfg, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({"quant_method": "fp8", **qcfg}, [])


def test_expert_shard_multiplies_like_its_slices_of_the_full_experts():
    """Routed experts in FP8 under tensor parallelism (rank 1 of 2, intermediate 272: its rows
    of gate and up and its columns of down start at 136, inside a block): each pair's SwiGLU
    output equals the one computed from the full dequantized weights' slices."""
    from matrixinfer.model.layers import RoutedExperts

    names = [f"e.experts.{e}.{p}.weight_scale_inv" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    cfg = config_from_dict({"quant_method": "fp8", "weight_block_size": [128, 128]}, names)
    layer = RoutedExperts(2, 160, 272, quant_config=cfg, prefix="e.experts", tp_rank=1, tp_size=2)
    full = {}
    for e in range(2):
        for piece, shape in (("gate_proj", (272, 160)), ("up_proj", (272, 160)), ("down_proj", (160, 272))):
            q, s = quantize_tensor(torch.randn(*shape, generator=G))
            param = "w2" if piece == "down_proj" else "w13"
            for suffix, t in (("weight", q), ("weight_scale_inv", s)):
                p = getattr(layer, f"{param}_{suffix}")
                p.weight_loader(p, t, (e, piece))
            full[e, piece] = dequantize_tensor(q, s, (128, 128), torch.float32)
    x = torch.randn(3, 160, generator=G)
    local = torch.tensor([[0, 1], [1, 1], [0, 0]])
    got = layer.quant_method.apply_pairs(layer, x, local)
    rows = slice(136, 272)
    for n in range(3):
        for j in range(2):
            e = int(local[n, j])
            h = torch.nn.functional.silu(full[e, "gate_proj"][rows] @ x[n]) * (full[e, "up_proj"][rows] @ x[n])
            want = full[e, "down_proj"][:, rows] @ h
            assert (got[n, j] - want).abs().max() <= 1e-5 * want.abs().max()


def test_quantize_from_the_fp8_release_equals_quantizing_its_dequantized_weights(tmp_path):
    """`matrixinfer quantize` from an FP8 checkpoint (dequantized at load, tensor by tensor) writes
    the same W8A8 checkpoint, to the bit, as from the same weights dequantized to float32."""
    from safetensors.torch import load_file

    from matrixinfer.quant.cli import quantize_checkpoint
    from matrixinfer.quant.quantize import QuantizeOptions
    from tests.hf_fixtures import make_fp8_checkpoint

    make_fp8_checkpoint(tmp_path / "fp8", tmp_path / "dequantized", num_hidden_layers=2)
    windows = torch.randint(2, 97, (4, 24), generator=torch.Generator().manual_seed(0))
    for name in ("fp8", "dequantized"):
        torch.manual_seed(0)
        quantize_checkpoint(tmp_path / name, tmp_path / f"{name}-w8a8", QuantizeOptions(block_size=32), windows,
                            batch_size=4, show_progress=False)
    a, b = (load_file(str(tmp_path / f"{n}-w8a8" / "model.safetensors")) for n in ("fp8", "dequantized"))
    assert a.keys() == b.keys() and any(t.dtype == torch.int8 for t in a.values())
    for k in a:
        assert torch.equal(a[k], b[k]), k
