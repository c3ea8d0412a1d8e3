"""DeepSeek-V3's FP8 release format (float8_e4m3fn weights, float32 `weight_scale_inv` per 128 x
128 block, quantization_config quant_method fp8) on a tiny random model whose widths straddle
128 (ragged edge blocks; q_a | kv_a merged off block edges): loaded with the weights kept in FP8
it serves the same greedy tokens as the same weights dequantized to float32 and served as a
plain float32 checkpoint (the oracle, written by tests/hf_fixtures.py), eager and compiled."""

import pytest
import torch

from matrixinfer import LLM, SamplingParams
from matrixinfer.model.loader import CheckpointError, load_model
from tests.hf_fixtures import make_fp8_checkpoint

IDS = torch.randint(2, 97, (2, 12), generator=torch.Generator().manual_seed(0))
POS = torch.arange(12).expand(2, 12)
PROMPTS = [IDS[0, :5].tolist(), IDS[1, :12].tolist()]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    make_fp8_checkpoint(root / "fp8", root / "dequantized")
    return root / "fp8", root / "dequantized"


def logits(model):
    with torch.no_grad():
        return model.compute_logits(model(IDS, POS)).float()


def greedy(path, **kw):
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_seqs=2, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_weights_stay_one_byte_with_block_scales(fp8):
    path, _ = fp8
    model = load_model(path, dtype="float32", keep_fp8=True)
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.fused_qkv_a_proj.weight.dtype == torch.float8_e4m3fn
    # q_a (136 rows: 2 blocks) | kv_a (144 + 8 rows: 2 blocks) over 160 columns (2 blocks)
    assert attn.fused_qkv_a_proj.weight_scale_inv.shape == (4, 2)
    assert moe.experts.w13_weight.dtype == moe.experts.w2_weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.float32  # absorbed decode reads it as a float weight
    assert model.lm_head.weight.dtype == torch.float32 and model.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_explicit_dtype_dequantizes_at_load_exactly(fp8):
    """dtype float32 on the FP8 checkpoint: every layer unquantized, the weights the oracle's
    to the bit, so the logits are equal."""
    path, oracle = fp8
    model = load_model(path, dtype="float32")
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    assert torch.equal(logits(model), logits(load_model(oracle, dtype="float32")))
    bf16 = load_model(path, dtype="bfloat16")
    ref = load_model(oracle, dtype="bfloat16")  # the oracle's float32 weights rounded to bfloat16
    for (name, p), (_, q) in zip(bf16.named_parameters(), ref.named_parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name


def test_fp8_greedy_tokens_equal_the_dequantized_float32_model(fp8):
    path, oracle = fp8
    expected, _ = greedy(oracle)
    got, llm = greedy(path, quantization="fp8")
    assert llm.engine.worker.model.model.layers[1].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert got == expected


def test_fp8_greedy_tokens_with_the_compiled_decode_step(fp8, monkeypatch):
    """What users run: decode steps through the torch.compile'd forward (the FP8 operator inside)."""
    monkeypatch.delenv("MATRIXINFER_ENFORCE_EAGER")
    path, oracle = fp8
    expected, _ = greedy(oracle, enforce_eager=True)
    got, llm = greedy(path, quantization="fp8", compile_prefill=False)
    compiled = llm.engine.worker.runner.compiled_decode
    assert compiled is not None and compiled.steps > 0
    assert got == expected


def test_batch_invariant_mode_dequantizes_the_fp8_checkpoint_and_keeps_its_tokens(fp8):
    """The FP8 operator sums a row one way alone, another among 2-16 rows, a third in a GEMM:
    batch-invariant mode loads the checkpoint dequantized (the oracle's weights, so its greedy
    tokens), and asking for FP8 weights with the mode is a clear error."""
    path, oracle = fp8
    expected, _ = greedy(oracle)
    got, llm = greedy(path, batch_invariant=True)
    assert not any(p.dtype == torch.float8_e4m3fn for p in llm.engine.worker.model.parameters())
    assert got == expected
    with pytest.raises(ValueError, match="batch_invariant with quantization fp8"):
        LLM(model=str(path), quantization="fp8", batch_invariant=True)


def test_fp8_on_a_float_checkpoint_is_a_clear_error(fp8):
    _, oracle = fp8
    with pytest.raises(CheckpointError, match="not an FP8 checkpoint"):
        load_model(oracle, dtype="float32", keep_fp8=True)
