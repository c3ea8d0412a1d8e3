"""Checkpoint loading: the layouts DeepSeek and transformers 4.x/5.x write, dtypes, expert
subsets, the MTP module, and clear errors for broken checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from matrixinfer.config import ModelConfig
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.loader import CheckpointError, load_model
from matrixinfer.model.saver import save_pretrained
from tests.hf_fixtures import make_checkpoint

IDS = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(0))
POS = torch.arange(16)[None]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3")
    hf = make_checkpoint(path, "v3-qlora-yarn")
    with torch.no_grad():
        ref = hf(IDS).logits
    return path, ref


def logits(model):
    with torch.no_grad():
        return model.compute_logits(model(IDS, POS)).float()


def test_sharded_checkpoint_with_index(v3, tmp_path):
    """Many safetensors shards plus model.safetensors.index.json load to the same model."""
    path, ref = v3
    sd = load_file(str(path / "model.safetensors"))
    names = sorted(sd)
    weight_map = {}
    for i in range(3):
        part = {n: sd[n] for n in names[i::3]}
        fname = f"model-0000{i + 1}-of-00003.safetensors"
        save_file(part, str(tmp_path / fname))
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert torch.allclose(logits(load_model(tmp_path, dtype="float32")), ref, atol=1e-4)


def test_transformers_4_config_with_rope_scaling(v3, tmp_path):
    """transformers 4.x / DeepSeek configs: `rope_scaling` + top-level `rope_theta`, explicit topk_method."""
    path, ref = v3
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert torch.allclose(logits(load_model(tmp_path, dtype="float32")), ref, atol=1e-4)


def test_fused_expert_tensors_are_split(v3, tmp_path):
    """Writers that fuse experts into [E, 2I, H] gate_up_proj / [E, H, I] down_proj load the same."""
    path, ref = v3
    sd = load_file(str(path / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(path)
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([sd.pop(f"{p}.{e}.gate_proj.weight"), sd.pop(f"{p}.{e}.up_proj.weight")])
                   for e in range(cfg.n_routed_experts)]
        down = [sd.pop(f"{p}.{e}.down_proj.weight") for e in range(cfg.n_routed_experts)]
        sd[f"{p}.gate_up_proj"], sd[f"{p}.down_proj"] = torch.stack(gate_up), torch.stack(down)
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert torch.allclose(logits(load_model(tmp_path, dtype="float32")), ref, atol=1e-4)


def test_bfloat16_load_close_to_float32(v3):
    """dtype='bfloat16' loads every weight in bf16 except the float32 router."""
    path, ref = v3
    model = load_model(path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert ((logits(model) - ref).norm() / ref.norm()).item() < 0.05


def test_expert_subset_loads_only_those_experts(v3):
    """Expert parallelism loads a subset: only those experts' weights are materialised."""
    path, _ = v3
    model = load_model(path, dtype="float32", expert_ids=[1, 5])
    experts = model.model.layers[2].mlp.experts
    assert experts.expert_ids == [1, 5] and experts.w13_weight.shape[0] == experts.w2_weight.shape[0] == 2
    full = load_model(path, dtype="float32").model.layers[2].mlp.experts
    assert torch.equal(experts.w13_weight[1], full.w13_weight[5])  # expert 5 sits in local slot 1
    assert torch.equal(experts.w2_weight[0], full.w2_weight[1])


def test_missing_tensor_is_named(v3, tmp_path):
    path, _ = v3
    sd = load_file(str(path / "model.safetensors"))
    del sd["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(tmp_path)


def test_mismatched_tensor_is_named(v3, tmp_path):
    path, _ = v3
    sd = load_file(str(path / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(7)
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(7,\).*\(32,\)"):
        load_model(tmp_path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_mtp_weights_round_trip_and_transformers_ignores_them(v3, tmp_path):
    """A checkpoint with an MTP layer (stored as model.layers.{L}.* like DeepSeek's) loads its
    MTP module in our loader, gives the same draft logits after a save/load, and transformers
    still loads the main model from it."""
    import transformers

    path, ref = v3
    cfg_dict = json.loads((path / "config.json").read_text())
    cfg_dict["num_nextn_predict_layers"] = 1
    torch.manual_seed(0)
    model = DeepseekForCausalLM(ModelConfig.from_hf(cfg_dict))
    base = load_model(path, dtype="float32")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.load_state_dict(base.state_dict(), strict=False)  # main weights from the checkpoint
    save_pretrained(model, tmp_path, cfg_dict, dtype=torch.float32)
    assert any(k.startswith("model.layers.3.eh_proj") for k in load_file(str(tmp_path / "model.safetensors")))
    loaded = load_model(tmp_path, dtype="float32")
    assert len(loaded.model.mtp) == 1
    with torch.no_grad():
        h = model(IDS, POS)
        a = model.compute_logits(model.mtp_forward(h[:, :-1], IDS[:, 1:], POS[:, 1:]))
        b = loaded.compute_logits(loaded.mtp_forward(loaded(IDS, POS)[:, :-1], IDS[:, 1:], POS[:, 1:]))
    assert torch.allclose(a, b, atol=1e-5)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).float().eval()
    with torch.no_grad():
        assert torch.allclose(hf(IDS).logits, ref, atol=1e-4)
