"""Typed configs. ModelConfig reads a Hugging Face config.json of the DeepSeek V2/V3 family."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    interleave: bool = True  # DeepSeek stores rope dims as interleaved pairs

    @classmethod
    def from_hf(cls, hf: dict, interleave: bool) -> "RopeConfig":
        # transformers 5.x writes `rope_parameters` (with rope_theta inside); DeepSeek's own
        # configs and transformers 4.x write `rope_scaling` plus a top-level `rope_theta`.
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = params.get("rope_type", params.get("type", "default")) or "default"
        if rtype not in ("default", "yarn"):
            raise ValueError(f"unsupported rope type {rtype!r} (supported: default, yarn)")
        cfg = cls(theta=float(theta), type=rtype, interleave=interleave)
        if rtype == "yarn":
            cfg.factor = float(params["factor"])
            cfg.original_max_position_embeddings = int(
                params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
            )
            cfg.beta_fast = float(params.get("beta_fast") or 32)
            cfg.beta_slow = float(params.get("beta_slow") or 1)
            cfg.mscale = float(params.get("mscale") or 0)
            cfg.mscale_all_dim = float(params.get("mscale_all_dim") or 0)
            cfg.truncate = bool(params.get("truncate", True))
        return cfg


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class ModelConfig:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    topk_method: str = "noaux_tc"  # noaux_tc | greedy | group_limited_greedy
    scoring_func: str = "sigmoid"  # sigmoid | softmax
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_id: list[int] = field(default_factory=lambda: [1])
    rope: RopeConfig = field(default_factory=RopeConfig)
    torch_dtype: str = "bfloat16"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer the latent cache holds c_kv (kv_lora_rank) and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type", "deepseek_v3")
        if model_type not in ("deepseek_v3", "deepseek_v2"):
            raise ValueError(f"unsupported model_type {model_type!r} (expected deepseek_v3 or deepseek_v2)")
        v3 = model_type == "deepseek_v3"
        eos = hf.get("eos_token_id", 1)
        n_experts = hf.get("n_routed_experts") or 0
        cfg = cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf.get("moe_intermediate_size", hf["intermediate_size"]),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            n_shared_experts=hf.get("n_shared_experts") or 0,
            n_routed_experts=n_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            # transformers' V3 always routes noaux_tc/sigmoid and V2 always softmax;
            # DeepSeek's own configs name the method explicitly.
            topk_method=hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=hf.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=[] if eos is None else (list(eos) if isinstance(eos, list) else [eos]),
            rope=RopeConfig.from_hf(hf, interleave=bool(hf.get("rope_interleave", True))),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
        )
        if cfg.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {cfg.topk_method!r}")
        if cfg.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"unsupported scoring_func {cfg.scoring_func!r}")
        if n_experts and n_experts % cfg.n_group:
            raise ValueError(f"n_routed_experts={n_experts} is not divisible by n_group={cfg.n_group}")
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: expected a Hugging Face model directory")
        return cls.from_hf(json.loads(path.read_text()))


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from max_num_seqs * max_model_len
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None
