"""`matrixinfer quantize` -> a compressed-tensors int8 checkpoint -> load_model and LLM(model=OUT):
the layout, the round trip, and the engine's paged path agreeing with the dense model."""

import json

import pytest
import torch
from safetensors import safe_open

from matrixinfer import LLM, SamplingParams
from matrixinfer.cli import main
from matrixinfer.model.loader import load_model

IDS = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
POS = torch.arange(24).expand(2, 24)


@pytest.fixture(scope="module")
def quantized(text_checkpoint, tmp_path_factory):
    src = text_checkpoint[0]
    out = tmp_path_factory.mktemp("w8a8")
    calib = out.parent / "calib.txt"
    calib.write_text("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n" * 40)
    rc = main(["quantize", "--model", str(src), "--out", str(out), "--calib-data", str(calib),
               "--num-samples", "4", "--seq-len", "48", "--block-size", "16"])
    assert rc == 0
    return src, out


def logits(model):
    with torch.no_grad():
        return model.compute_logits(model(IDS, POS)).float()


def test_checkpoint_is_the_compressed_tensors_int8_layout(quantized):
    _, out = quantized
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "int-quantized"
    group = qcfg["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        q = "model.layers.1.self_attn.q_a_proj"
        assert f.get_tensor(f"{q}.weight").dtype == torch.int8
        assert f.get_tensor(f"{q}.weight_scale").shape == (f.get_tensor(f"{q}.weight").shape[0], 1)
        assert f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == torch.int8
        for float_name in ("lm_head.weight", "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight",
                           "model.layers.1.input_layernorm.weight"):
            assert f.get_tensor(float_name).is_floating_point(), float_name
    assert not any(k.endswith("input_scale") for k in keys)  # dynamic per-token activations


def test_loader_detects_it_and_stays_close_to_the_float_model(quantized):
    src, out = quantized
    ref, q = logits(load_model(src, dtype="float32")), load_model(out, dtype="float32")
    assert q.quantized
    got = logits(q)
    # hidden size 32 with random weights: int8 noise is relatively large (naive per-tensor gives
    # about 9 %, per-channel/per-token about 3-5 %, plus bf16 storage of the float layers)
    assert ((got - ref).norm() / ref.norm()).item() < 0.15
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_llm_serves_the_int8_checkpoint_like_the_dense_int8_model(quantized):
    _, out = quantized
    model = load_model(out, dtype="float32")
    prompt = IDS[0, :8].tolist()
    ids = list(prompt)
    with torch.no_grad():  # dense greedy oracle over the same int8 weights
        for _ in range(12):
            x = torch.tensor([ids])
            ids.append(int(model.compute_logits(model(x, torch.arange(len(ids))[None]))[0, -1].argmax()))
    llm = LLM(model=str(out), dtype="float32", block_size=4, quantization="w8a8")
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert got == ids[len(prompt):]


def test_asking_for_w8a8_on_a_float_checkpoint_is_a_clear_error(quantized):
    src, _ = quantized
    with pytest.raises(ValueError, match="matrixinfer quantize"):
        LLM(model=str(src), dtype="float32", quantization="w8a8")


@pytest.mark.slow
def test_expert_parallel_serves_the_int8_checkpoint_like_one_process(quantized):
    """EP=2 over the W8A8 checkpoint, with redundant experts rebalanced every step (int8
    weights and their scales move between ranks): the same greedy tokens as one process."""
    _, out = quantized
    kw = dict(model=str(out), dtype="float32", block_size=4, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": IDS[i, :n].tolist()} for i, n in ((0, 8), (1, 13), (0, 19))]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, p, use_tqdm=False)]
    with LLM(expert_parallel_size=2, dispatch_dtype="float32", num_redundant_experts=2, eplb_interval=1, **kw) as ep:
        assert [o.outputs[0].token_ids for o in ep.generate(prompts, p, use_tqdm=False)] == expected
