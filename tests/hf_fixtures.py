"""Tiny random DeepSeek V2/V3 checkpoints written by transformers' own save_pretrained:
the oracle side of every model test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=12, max_position_embeddings=256, first_k_dense_replace=1, bos_token_id=0, eos_token_id=1,
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (config class name, overrides)
VARIANTS = {
    "v3-qlora-yarn": ("DeepseekV3Config", dict(q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2,
                                              num_experts_per_tok=3, routed_scaling_factor=2.5, rope_parameters=YARN)),
    "v3-noqlora": ("DeepseekV3Config", dict(q_lora_rank=None, n_routed_experts=8, n_group=2, topk_group=1,
                                           num_experts_per_tok=2, rope_interleave=False, n_shared_experts=2)),
    "v2-greedy": ("DeepseekV2Config", dict(q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2,
                                          topk_method="greedy", n_shared_experts=1, routed_scaling_factor=1.0)),
    "v2-group-limited-yarn": ("DeepseekV2Config", dict(q_lora_rank=20, n_routed_experts=8, n_group=4, topk_group=2,
                                                      num_experts_per_tok=2, topk_method="group_limited_greedy",
                                                      n_shared_experts=1, rope_parameters=YARN)),
}


def make_checkpoint(path: Path, variant: str, seed: int = 0, **extra):
    """Save a random tiny model of `variant` with transformers and return the HF model (float32, eval)."""
    import transformers

    cls_name, overrides = VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**TINY, **overrides, **extra})
    model_cls = transformers.DeepseekV3ForCausalLM if "V3" in cls_name else transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # random weights large enough that routing and attention matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.2)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def make_tokenizer(path: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE tokenizer (trained on a few lines of Python) with <bos>/<eos>, written
    as tokenizer.json + tokenizer_config.json like a Hugging Face model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
            "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"] * 20
    tok.train_from_iterator(text, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}",
    }))


# widths that straddle 128 (ragged edge blocks, merged pieces not on block edges) yet stay fast
FP8_WIDE = dict(hidden_size=160, intermediate_size=272, moe_intermediate_size=144, q_lora_rank=136, kv_lora_rank=144)


def make_fp8_checkpoint(fp8_dir: Path, dequant_dir: Path, variant: str = "v3-qlora-yarn",
                        block: tuple[int, int] = (128, 128), **extra) -> None:
    """A tiny random model in DeepSeek-V3's FP8 release format (fp8_dir: every projection
    float8_e4m3fn with a float32 `weight_scale_inv` per block, its config's quantization_config
    as the release writes it) and the same weights dequantized to float32 as a plain checkpoint
    (dequant_dir: the oracle; every block multiplied by its scale in a loop written here)."""
    from safetensors.torch import load_file, save_file

    from matrixinfer.quant.fp8 import RELEASE_FP8, quantize_tensor

    make_checkpoint(dequant_dir, variant, **{**FP8_WIDE, **extra})
    fp8_dir.mkdir(parents=True, exist_ok=True)
    for name in dequant_dir.iterdir():
        if name.suffix != ".safetensors":
            shutil.copy(name, fp8_dir / name.name)
    tensors = load_file(str(dequant_dir / "model.safetensors"))
    fp8, dequant = {}, {}
    bn, bk = block
    for name, w in tensors.items():
        if not RELEASE_FP8.match(name):
            fp8[name] = dequant[name] = w
            continue
        q, scale = quantize_tensor(w, block)
        fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
        d = q.float()
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                d[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
        dequant[name] = d
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(dequant, str(dequant_dir / "model.safetensors"))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=2))
