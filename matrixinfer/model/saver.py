"""Write a DeepseekForCausalLM as a Hugging Face directory that both our loader and
transformers' DeepseekV3ForCausalLM read: MTP modules go back to `model.layers.{L+k}.*`
with the copies of the embedding and head DeepSeek checkpoints carry, and merged or stacked
parameters are split back into one tensor per projection and expert (weight_map.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.weight_map import checkpoint_tensors
from matrixinfer.parallel.state import get_tp_size


def checkpoint_state_dict(model: DeepseekForCausalLM, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    if get_tp_size() != 1:
        raise RuntimeError("save from a single process: under tensor parallelism each rank holds only a shard")
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in checkpoint_tensors(model):  # merged and stacked parameters split back
        if name.startswith("model.mtp."):
            k, rest = name[len("model.mtp."):].split(".", 1)
            name = f"model.layers.{cfg.num_hidden_layers + int(k)}.{rest}"
        out[name] = stored(name, t, dtype)
    for k in range(len(model.model.mtp)):
        prefix = f"model.layers.{cfg.num_hidden_layers + k}."
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().to(dtype).contiguous().clone()
    return out


def stored(name: str, t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A parameter as the checkpoint stores it: int8 weights as they are, the router and int8
    scales in float32, the rest in `dtype`."""
    keep_fp32 = ".mlp.gate." in name or name.endswith("_scale")  # router weight and bias; int8 scales
    keep = t.dtype == torch.int8  # quantized weights are written as they are
    return t.detach().to(t.dtype if keep else torch.float32 if keep_fp32 else dtype).contiguous().clone()


def save_pretrained(model: DeepseekForCausalLM, out_dir: str | Path, hf_config: dict, dtype: torch.dtype = torch.bfloat16):
    """hf_config: the config.json dict (e.g. DeepseekV3Config(...).to_dict() or a hand-written
    one; a quantized model's carries its `quantization_config`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_state_dict(model, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {**hf_config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
