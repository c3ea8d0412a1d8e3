"""Model as data: the dimensions the cost model needs, read from a Hugging Face config.json.

DeepSeek-style configs (MLA + DeepSeekMoE) are the main case; a plain dense GQA config
(Llama/Qwen style) is read too, so other models can be simulated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from matrixinfer.sim.hardware import SpecError

MODELS_DIR = Path(__file__).parent / "models"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    # attention: MLA when kv_lora_rank > 0, else GQA with kv_heads x head_dim
    q_lora_rank: int  # 0 = full-rank query projection
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    kv_heads: int
    # feed-forward
    dense_intermediate: int
    dense_layers: int  # leading layers with a dense FFN
    moe_intermediate: int
    routed_experts: int  # 0 = dense model
    shared_experts: int
    top_k: int
    mtp_layers: int

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.routed_experts else 0

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    # ---- parameter counts (weights, not bytes) ----
    def q_params(self) -> int:
        q_out = self.heads * self.qk_dim
        if self.q_lora_rank:
            return self.hidden * self.q_lora_rank + self.q_lora_rank * q_out
        return self.hidden * q_out

    def attention_params(self) -> int:
        """Weights of one attention block as stored (MLA: q_a, q_b, kv_a, kv_b, o)."""
        if self.is_mla:
            kv_a = self.hidden * (self.kv_lora_rank + self.qk_rope_dim)
            kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_dim)
            return self.q_params() + kv_a + kv_b + self.heads * self.v_dim * self.hidden
        kv = 2 * self.hidden * self.kv_heads * self.qk_dim
        return self.q_params() + kv + self.heads * self.v_dim * self.hidden

    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    def total_params(self, include_mtp: bool = False) -> int:
        moe = self.moe_layers * ((self.routed_experts + self.shared_experts) * self.expert_params()
                                 + self.hidden * self.routed_experts)
        dense = (self.layers - self.moe_layers) * self.dense_ffn_params()
        attn = self.layers * self.attention_params()
        total = moe + dense + attn + 2 * self.vocab * self.hidden
        if include_mtp:
            per_mtp = (self.attention_params() + (self.routed_experts + self.shared_experts) * self.expert_params()
                       + 2 * self.hidden * self.hidden)
            total += self.mtp_layers * per_mtp
        return total

    def activated_params_per_token(self) -> int:
        ffn = self.moe_layers * (self.top_k + self.shared_experts) * self.expert_params()
        ffn += (self.layers - self.moe_layers) * self.dense_ffn_params()
        return ffn + self.layers * self.attention_params() + self.vocab * self.hidden

    def kv_elems_per_token_layer(self) -> int:
        """Cached elements per token per layer: the MLA latent (512 + 64) or K and V."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.qk_dim


def _int(cfg: dict, key: str, where: str, default=None) -> int:
    v = cfg.get(key, default)
    if v is None:
        if default is None:
            raise SpecError(f"{where}: missing field '{key}'")
        v = default
    if not isinstance(v, (int, float)) or v < 0:
        raise SpecError(f"{where}.{key}: expected a non-negative integer, got {v!r}")
    return int(v)


def model_from_config(cfg: dict, name: str = "model") -> ModelSpec:
    w = name
    hidden = _int(cfg, "hidden_size", w)
    heads = _int(cfg, "num_attention_heads", w)
    layers = _int(cfg, "num_hidden_layers", w)
    if hidden == 0 or heads == 0 or layers == 0:
        raise SpecError(f"{w}: hidden_size, num_attention_heads and num_hidden_layers must be > 0")
    kv_lora = _int(cfg, "kv_lora_rank", w, 0)
    if kv_lora:
        nope, rope, v = (_int(cfg, k, w) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        kv_heads = heads
    else:
        head_dim = _int(cfg, "head_dim", w, hidden // heads)
        nope, rope, v = head_dim, 0, head_dim
        kv_heads = _int(cfg, "num_key_value_heads", w, heads)
    routed = _int(cfg, "n_routed_experts", w, 0) or _int(cfg, "num_local_experts", w, 0)
    top_k = _int(cfg, "num_experts_per_tok", w, 0) if routed else 0
    if routed and not 0 < top_k <= routed:
        raise SpecError(f"{w}.num_experts_per_tok: must be in 1..{routed}, got {top_k}")
    dense_inter = _int(cfg, "intermediate_size", w)
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        vocab=_int(cfg, "vocab_size", w),
        heads=heads,
        q_lora_rank=_int(cfg, "q_lora_rank", w, 0),
        kv_lora_rank=kv_lora,
        qk_nope_dim=nope,
        qk_rope_dim=rope,
        v_dim=v,
        kv_heads=kv_heads,
        dense_intermediate=dense_inter,
        dense_layers=min(layers, _int(cfg, "first_k_dense_replace", w, 0)) if routed else layers,
        moe_intermediate=_int(cfg, "moe_intermediate_size", w, dense_inter) if routed else 0,
        routed_experts=routed,
        shared_experts=_int(cfg, "n_shared_experts", w, 0) if routed else 0,
        top_k=top_k,
        mtp_layers=_int(cfg, "num_nextn_predict_layers", w, 0),
    )


def available_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_model(name_or_path: str | Path) -> ModelSpec:
    """Load a bundled model by name (e.g. 'deepseek-r1') or any HF config.json by path."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    elif not path.suffix:
        path = MODELS_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise SpecError(f"no model config {path} (bundled: {', '.join(available_models())})")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from None
    stem = path.parent.name if path.name == "config.json" else path.stem
    return model_from_config(cfg, name=stem)
