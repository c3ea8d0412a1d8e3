"""Load a Hugging Face DeepSeek-V2/V3 directory (config.json + one or many safetensors files)
into DeepseekForCausalLM: memory-mapped, any float dtype, optionally only some experts.

Each checkpoint tensor goes to its parameter's weight_loader (weight_map.py names the
parameter and the shard_id: merged projections and stacked experts take several tensors),
which copies only this tensor-parallel rank's part. What differs between checkpoint layouts
is mapped here:
- MTP modules are stored as layers past num_hidden_layers (`model.layers.{L+k}.*`) and live
  in `model.mtp.{k}.*`; their copies of the embedding and LM head are skipped (shared).
- Some writers fuse experts into `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`
  [E, ...] tensors; they are split per expert.
- DeepSeek's FP8 release (float8 weights + `weight_scale_inv` block scales, quant/fp8.py): kept
  in FP8 through their layers' method, or each tensor dequantized with its scale as it is
  copied (an explicit dtype), never the whole model at once.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.layers import QuantizationConfig, default_weight_loader
from matrixinfer.model.moe import Router
from matrixinfer.model.weight_map import checkpoint_tensors, param_for
from matrixinfer.quant.fp8 import SCALE_SUFFIX, Fp8Config, dequantize_tensor, is_fp8_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    pass


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (choose auto, float32, bfloat16, float16)")
    return DTYPES[dtype]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {missing}")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def _target_name(name: str, cfg: ModelConfig, with_mtp: bool) -> str | None:
    """Our name for one checkpoint tensor; None means skip it. Fused expert tensors map to
    `<prefix>.*.<kind>`, expanded per expert by the caller."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        k, rest = int(m.group(1)) - cfg.num_hidden_layers, m.group(2)
        if not with_mtp or k >= cfg.num_nextn_predict_layers:
            return None
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            return None
        return f"model.mtp.{k}.{rest}"
    fused = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if fused:
        prefix, kind = fused.groups()
        return f"{prefix}.*.{kind}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name


class _Tensors:
    """Checkpoint tensors already in memory (e.g. from the EMS model cache) with the part of
    safetensors' safe_open surface the loader uses."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str):
        return SimpleNamespace(get_dtype=lambda: str(self.tensors[name].dtype))


@contextmanager
def _opened(files: list[Path], weights: dict | None):
    if weights is not None:
        yield [_Tensors(weights)]
        return
    with ExitStack() as stack:
        yield [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in files]


def checkpoint_quant_config(model_dir: Path, cfg: ModelConfig, keys: list[str] = (),
                            dtype: torch.dtype = torch.bfloat16, keep_fp8: bool = True) -> QuantizationConfig | None:
    """The method a quantized checkpoint asks for (config.json `quantization_config`), or None.
    An FP8 checkpoint (quant_method fp8) keeps its weights in FP8 (keep_fp8), else every layer is
    unquantized in `dtype` and the loader dequantizes each tensor as it copies it (quant/fp8.py)."""
    qcfg = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if not qcfg:
        return None
    from matrixinfer.quant import config_from_dict, fp8

    if qcfg.get("quant_method") == fp8.QUANT_METHOD:
        return fp8.config_from_dict(qcfg, keys, cfg.num_hidden_layers, dequantize=not keep_fp8, dtype=dtype)
    return config_from_dict(qcfg, cfg.num_hidden_layers)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    expert_ids: list[int] | None = None,
    with_mtp: bool = True,
    quant_config: QuantizationConfig | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    keep_fp8: bool | None = None,
    only: Callable[[str], bool] | None = None,
) -> DeepseekForCausalLM:
    """This tensor-parallel rank's shard of the model (parallel/state.py; the whole model in
    one process). quant_config chooses how linear layers store weights (None: what the
    checkpoint's config.json says, unquantized without a quantization_config).
    weights: the checkpoint's tensors already in memory (the EMS model cache) instead of
    reading the directory's safetensors files (config.json still comes from model_dir).
    keep_fp8, for an FP8 checkpoint (quant/fp8.py): True keeps the weights in FP8 with
    activations in `dtype`; False dequantizes them to `dtype` at load, tensor by tensor; None
    (default): keep them with dtype "auto", dequantize with an explicit dtype.
    only: load just the tensors whose name (ours, experts one by one) it accepts; every other
    parameter stays on the meta device, holding no memory (the streaming quantizer's one layer)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    files = checkpoint_files(model_dir) if weights is None else []
    # MTP weights are optional: transformers' save_pretrained drops them, DeepSeek ships them.
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    keys = list(weights) if weights is not None else [k for path in files for k in _keys(path)]
    quant_config = quant_config or checkpoint_quant_config(model_dir, cfg, keys, torch_dtype,
                                                           dtype == "auto" if keep_fp8 is None else keep_fp8)
    fp8_config = quant_config if isinstance(quant_config, Fp8Config) else None
    if keep_fp8 and (fp8_config is None or not fp8_config.fp8_modules):
        raise CheckpointError(f"FP8 weights asked for, but {model_dir} is not an FP8 checkpoint (quantization_config "
                              "quant_method fp8 with weight_scale_inv tensors)")
    with_mtp = with_mtp and cfg.num_nextn_predict_layers > 0 and any(k.startswith(mtp_prefix) for k in keys)
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, expert_ids, with_mtp, quant_config).to(torch_dtype)
    for router in model.modules():
        if isinstance(router, Router):  # the gate stays float32 whatever the model dtype
            router.float()
    for p in model.parameters():
        if getattr(p, "keep_dtype", None) is not None:  # quantization scales, FP8 weights
            p.data = p.data.to(p.keep_dtype)
    materialize(model, device, only)
    for layer in model.attention_layers():
        if not layer.rotary.inv_freq.is_meta:
            layer.rotary.reset_parameters()  # non-persistent buffers are not in the checkpoint
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    # this rank's tensors, by checkpoint name
    expected = {name for name, _ in checkpoint_tensors(model) if only is None or only(name)}
    loaded: set[str] = set()

    def held_elsewhere(name: str) -> bool:
        """An expert weight of an expert this process does not hold (expert parallelism)."""
        return expert_ids is not None and name not in expected and bool(re.search(r"\.mlp\.experts\.\d+\.", name))

    def wanted(target: str) -> bool:
        """`only` accepts it (a fused experts tensor: if it accepts its expert 0's pieces)."""
        return only is None or only(target.replace(".*.", ".0."))

    def copy(name: str, tensor: torch.Tensor, source: str):
        if held_elsewhere(name):
            return
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {source!r} in checkpoint (maps to {name!r})")
        param_name, shard_id = param_for(name, params)
        param = params[param_name]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:  # the loader narrows the full tensor to this rank's shard
            weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise CheckpointError(f"tensor {source!r}: {e}") from None
        loaded.add(name)

    with _opened(files, weights) as opened:
        holder = {source: f for f in opened for source in f.keys()}
        for f in opened:
            for source in f.keys():
                tensor_fp8 = is_fp8_dtype(str(f.get_slice(source).get_dtype()))
                if (tensor_fp8 or source.endswith(SCALE_SUFFIX)) and fp8_config is None:
                    raise CheckpointError(f"tensor {source!r} is FP8-quantized but config.json has no fp8 "
                                          "quantization_config (quant_method fp8, weight_block_size)")
                if fp8_config is not None and fp8_config.dequantize:
                    if source.endswith(SCALE_SUFFIX):
                        continue  # read with its weight
                    if tensor_fp8:  # this one tensor dequantized to the model dtype, then copied
                        scale = f"{source.removesuffix('.weight')}{SCALE_SUFFIX}"
                        if scale not in holder:
                            raise CheckpointError(f"FP8 tensor {source!r} has no {scale!r}")
                        target = _target_name(source, cfg, with_mtp)
                        if target is not None and not held_elsewhere(target) and wanted(target):
                            copy(target, dequantize_tensor(f.get_tensor(source), holder[scale].get_tensor(scale),
                                                           fp8_config.block, torch_dtype), source)
                        continue
                if source.endswith("_zero_point"):  # symmetric int8: all zeros, nothing to load
                    if f.get_tensor(source).any():
                        raise CheckpointError(f"tensor {source!r}: asymmetric quantization is not supported")
                    continue
                target = _target_name(source, cfg, with_mtp)
                if target is None or held_elsewhere(target) or not wanted(target):
                    continue  # not read from disk at all
                if ".*." in target:  # fused experts [E, ...]
                    t = f.get_tensor(source)
                    base, kind = target.split(".*.")
                    for e in range(t.shape[0]):
                        if kind == "gate_up_proj":
                            gate, up = t[e].chunk(2, dim=0)
                            copy(f"{base}.{e}.gate_proj.weight", gate, source)
                            copy(f"{base}.{e}.up_proj.weight", up, source)
                        else:
                            copy(f"{base}.{e}.down_proj.weight", t[e], source)
                else:
                    copy(target, f.get_tensor(source), source)
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s), first: {missing[:5]}")
    for module in model.modules():
        if hasattr(module, "quant_method") and not any(p.is_meta for p in module.parameters(recurse=False)):
            module.quant_method.process_weights_after_loading(module)
    return model.eval()


def materialize(model: nn.Module, device: str | torch.device, only: Callable[[str], bool] | None = None) -> None:
    """Like Module.to_empty(device): meta tensors become uninitialised ones on `device`, but
    parameters keep their attributes (weight_loader, output_dim, ...) and tied ones stay tied.
    only: the parameters of the modules whose name + "." it accepts; the rest stay meta."""
    new: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        if only is not None and not only(f"{mod_name}."):
            continue
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in new:
                q = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                new[id(p)] = q
            module._parameters[name] = new[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=device)
