"""`matrixinfer bench make-model`: a random checkpoint with a real model's layer shapes (widths,
heads, latent ranks, vocabulary, expert counts and routing), fewer layers: the workload that
speed on real shapes is measured on (weights streamed from DRAM, not the CPU's cache).

The tensor names and shapes come from our own model built on the meta device
(weight_map.checkpoint_tensors: what the loader expects), so the writer and the loader cannot
disagree. Tensors are drawn one at a time and written in safetensors shards of about
`shard_gb` with an index, so memory stays one shard whatever the model's size. Weights are
scaled so activations stay in a sane range: every projection N(0, 1/fan_in) (unit variance
through it), the residual branches' output projections (o_proj, down_proj) further by
1/sqrt(2 * layers), norms 1, the router's correction bias 0. With `fp8` the projections are
written as DeepSeek's FP8 release writes them (quant/fp8.py: float8_e4m3fn with a float32
weight_scale_inv per 128 x 128 block, its quantization_config).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# config.json of each real model, as its Hugging Face release has it (num_hidden_layers replaced)
SHAPES: dict[str, dict] = {
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    },
}
RESIDUAL_OUT = (".o_proj.weight", ".down_proj.weight")  # outputs added into the residual stream


def hf_config(shape: str | dict, layers: int, fp8: bool = False, **overrides) -> dict:
    """The config.json of `shape` (a SHAPES name or a dict of its fields) cut to `layers` decoder
    layers, no MTP module. The dense layers come first as in the release, but at most layers - 1
    of them, so a cut model keeps at least one MoE layer."""
    cfg = dict(SHAPES[shape] if isinstance(shape, str) else shape, **overrides)
    cfg.update(num_hidden_layers=layers, num_nextn_predict_layers=0, torch_dtype="bfloat16",
               first_k_dense_replace=min(cfg["first_k_dense_replace"], max(layers - 1, 0)))
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return cfg


def checkpoint_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor the loader expects for this config, in order."""
    from matrixinfer.config import ModelConfig
    from matrixinfer.model.deepseek import DeepseekForCausalLM
    from matrixinfer.model.weight_map import checkpoint_tensors

    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_hf(cfg), None, False)
    return [(name, tuple(t.shape)) for name, t in checkpoint_tensors(model)]


def random_tensor(name: str, shape: tuple[int, ...], layers: int, gen: torch.Generator) -> torch.Tensor:
    """One tensor of the random model, float32 (scaled as the module docstring says)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape)
    std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(shape[-1])
    if name.endswith(RESIDUAL_OUT):
        std /= math.sqrt(2 * layers)
    return torch.randn(shape, generator=gen) * std


def write_model(out: str | Path, shape: str | dict, layers: int, fp8: bool = False, seed: int = 0,
                shard_gb: float = 2.0, **overrides) -> dict:
    """Write the checkpoint (config.json, safetensors shards + index); returns a summary."""
    from matrixinfer.quant.fp8 import RELEASE_FP8, SCALE_SUFFIX, quantize_tensor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape, layers, fp8, **overrides)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes, weight_map, total, params = [0], {}, 0, 0

    def put(name: str, t: torch.Tensor) -> None:
        nonlocal total
        nbytes = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nbytes > shard_gb * 1e9:
            _flush(out, shards)
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t
        sizes[-1] += nbytes
        weight_map[name] = len(shards) - 1
        total += nbytes

    for name, shp in checkpoint_shapes(cfg):
        w = random_tensor(name, shp, layers, gen)
        params += w.numel()
        if fp8 and RELEASE_FP8.match(name):
            q, scale = quantize_tensor(w)
            put(name, q)
            put(name.removesuffix(".weight") + SCALE_SUFFIX, scale)
        else:
            # bf16 as the release, but the router's correction bias (float32 there too)
            put(name, w if name.endswith("e_score_correction_bias") else w.to(torch.bfloat16))
        del w
    _flush(out, shards)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        (out / f"shard-{i}.safetensors").rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"out": str(out), "parameters": params, "bytes": total, "shards": len(names),
            "seconds": round(time.perf_counter() - start, 1)}


def _flush(out: Path, shards: list[dict]) -> None:
    """Write the open shard (named shard-<i> until all are known) and free its tensors."""
    i = len(shards) - 1
    save_file(shards[i], str(out / f"shard-{i}.safetensors"), metadata={"format": "pt"})
    shards[i] = {}


def cmd_make_model(args) -> int:
    summary = write_model(args.out_dir, args.shape, args.layers, fp8=args.fp8, seed=args.seed,
                          shard_gb=args.shard_gb)
    print(f"wrote {summary['out']}: {args.shape} shapes, {args.layers} layers, {summary['parameters'] / 1e9:.2f}B "
          f"parameters, {summary['bytes'] / 1e9:.2f} GB in {summary['shards']} shard(s), {summary['seconds']} s")
    return 0


def register(bench_sub) -> None:
    p = bench_sub.add_parser("make-model", help="a random checkpoint with a real model's layer shapes, fewer layers")
    p.add_argument("out_dir", metavar="OUT", help="output directory")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, required=True, help="decoder layers (the release's dense ones first)")
    p.add_argument("--fp8", action="store_true", help="DeepSeek's FP8 release format (float8_e4m3fn + block scales)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=2.0, help="safetensors shard size")
    p.set_defaults(func=cmd_make_model)
