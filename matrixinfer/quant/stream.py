"""`matrixinfer quantize --stream`: the W8A8 checkpoint written one decoder layer at a time, in
memory bounded by the calibration activations plus a layer's weights (its float copy, its
quantized copy and its calibration statistics), whatever the model's depth; resumable.

The same algorithm as quantize.py, in the same order, so the output equals the in-memory
quantizer's to the bit (tested): the calibration hidden states enter layer i, its inputs'
statistics are recorded while the float layer maps them to layer i + 1's (one pass of the float
model, as calibrate.py), then the layer is smoothed and quantized alone. Each layer is loaded by
load_model(only=...) (the loader's name map and FP8 dequantization, nothing else in memory).

Resuming: `<OUT>/.partial/` keeps each finished layer's tensors (`layer-<i>.safetensors`) and the
hidden states after the last finished layer (`hidden-<i>.pt`), each written to a temporary name
and renamed, so a kill leaves either the old or the new file; a rerun starts after the last
layer whose shard and following hidden states both exist.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from matrixinfer.config import ModelConfig
from matrixinfer.model.deepseek import DecoderLayer
from matrixinfer.model.loader import checkpoint_files, load_model
from matrixinfer.model.saver import stored
from matrixinfer.model.weight_map import checkpoint_tensors
from matrixinfer.quant.calibrate import collect_stats
from matrixinfer.quant.compressed_tensors import config_to_dict
from matrixinfer.quant.quantize import default_ignore, quantize_into, smooth_model
from matrixinfer.quant.w8a8 import W8A8Config


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _layer_tensors(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{name}": stored(f"{prefix}{name}", t) for name, t in checkpoint_tensors(module)}


def quantize_streaming(model_dir: str | Path, out_dir: str | Path, opts, windows: torch.Tensor, batch_size: int = 8,
                       show_progress: bool = True) -> dict:
    """quant/cli.quantize_checkpoint's result, one decoder layer in memory at a time."""
    from tqdm import tqdm

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    n_layers = cfg.num_hidden_layers
    work = out_dir / ".partial"
    work.mkdir(parents=True, exist_ok=True)

    def load(*prefixes: str):
        return load_model(model_dir, dtype="float32", only=lambda name: name.startswith(prefixes))

    def done(i: int) -> bool:
        return (work / f"layer-{i}.safetensors").exists() and (work / f"hidden-{i + 1}.pt").exists()

    start = next((i for i in range(n_layers) if not done(i)), n_layers)
    if start == 0 and not (work / "hidden-0.pt").exists():
        embed = load("model.embed_tokens.").model.embed_tokens
        with torch.no_grad():
            hidden = embed(windows)
        _atomic(work / "hidden-0.pt", lambda p: torch.save(hidden, p))
    positions = torch.arange(windows.shape[1]).expand_as(windows)
    # MTP modules (stored as layers past the last; transformers' writer drops them) stay float
    n_mtp = len({int(m.group(1)) for path in checkpoint_files(model_dir) for k in _keys(path)
                 if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= n_layers})
    ignore = default_ignore(n_layers, n_mtp)
    qcfg = W8A8Config(ignore, n_layers, opts.act_strategy)
    bar = tqdm(total=n_layers, initial=start, desc="quantize", unit="layer", disable=not show_progress)
    for i in range(start, n_layers):
        prefix = f"model.layers.{i}."
        model = load(prefix)
        layer = model.model.layers[i]
        hidden = torch.load(work / f"hidden-{i}.pt")
        outputs = []

        def forward(h, layer=layer, outputs=outputs):  # as DeepseekModel.forward runs a layer
            outputs.append(layer(h, layer.self_attn.rotary.cos_sin(positions[:h.shape[0]], h.dtype)))

        with torch.no_grad():
            stats = collect_stats(model, hidden.split(batch_size), forward=forward)
        hidden = torch.cat(outputs)
        if opts.smooth_alpha is not None and not opts.naive:
            smooth_model(model, stats, opts.smooth_alpha, layers=[i])
        qlayer = DecoderLayer(cfg, i, None, qcfg, prefix=prefix.rstrip(".")).to(torch.float32)
        quantize_into(layer, qlayer, stats, opts, prefix=prefix)
        tensors = _layer_tensors(qlayer, prefix)
        del model, layer, qlayer, stats, outputs, forward
        gc.collect()  # parameters point back at their layer (weight_loader): freed by the cycle collector
        _atomic(work / f"layer-{i}.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        _atomic(work / f"hidden-{i + 1}.pt", lambda p: torch.save(hidden, p))
        (work / f"hidden-{i}.pt").unlink(missing_ok=True)
        bar.update(1)
    bar.close()
    # the rest stays float: embeddings, final norm, LM head, the MTP modules (not calibrated)
    rest = load("model.embed_tokens.", "model.norm.", "lm_head.", "model.mtp.")
    tensors = {}
    for name, t in checkpoint_tensors(rest):
        m = re.match(r"model\.mtp\.(\d+)\.(.*)", name)
        if m:
            name = f"model.layers.{n_layers + int(m.group(1))}.{m.group(2)}"
        elif name.startswith("model.layers."):
            continue
        tensors[name] = stored(name, t)
    for k in range(n_mtp):  # DeepSeek's MTP layers carry copies of the embedding and the head
        tensors[f"model.layers.{n_layers + k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{n_layers + k}.shared_head.head.weight"] = stored("lm_head.weight", rest.lm_head.weight)
    _atomic(work / "rest.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    del rest, tensors
    names = [f"layer-{i}.safetensors" for i in range(n_layers)] + ["rest.safetensors"]
    final = [f"model-{j + 1:05d}-of-{len(names):05d}.safetensors" for j in range(len(names))]
    weight_map = {}
    for src, dst in zip(names, final):
        weight_map.update({k: dst for k in _keys(work / src)})
        os.replace(work / src, out_dir / dst)
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=1))
    hf = json.loads((model_dir / "config.json").read_text())
    hf["quantization_config"] = config_to_dict(ignore, "channel", opts.act_strategy)
    hf["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(work)
    return {"layers": n_layers, "resumed_at": start}


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())
