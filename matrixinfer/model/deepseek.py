"""The DeepSeek-V3 family (also V2) as plain PyTorch: decoder layers, the model, the LM head
and the multi-token-prediction (MTP) module. Parameter names equal the Hugging Face
checkpoint names except where projections are merged or stacked (fused_qkv_a_proj,
gate_up_proj, experts.w13_weight / w2_weight); weight_map.py translates both ways.

Tensor parallelism lives in the layers (layers/linear.py): attention heads and MLP/expert
intermediate dimensions are split over the ranks, with one all-reduce per attention block
and one per MLP/MoE block. The embedding and the LM head are replicated (a vocab-parallel
head is a possible later step).
"""

from __future__ import annotations

import torch
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.model.attention import MLAttention
from matrixinfer.model.layers import MLP, QuantizationConfig, ReplicatedLinear, RMSNorm
from matrixinfer.model.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_ids: list[int] | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx, quant_config, prefix=f"{prefix}.self_attn")
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, expert_ids, quant_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # plain code (MoE.forward runs its own stages under EP): the compiled decode step traces it whole
        h = h + self.self_attn(self.input_layernorm(h), rope)
        return h + self.mlp(self.post_attention_layernorm(h))

    def stages(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """forward() as a generator yielding while the MoE's exchanges fly (moe.py)."""
        x, attn = self.input_layernorm(h), self.self_attn
        h = h + ((yield from attn.stages(x, rope)) if attn.sequence_parallel else attn(x, rope))
        x = self.post_attention_layernorm(h)
        return h + ((yield from self.mlp.stages(x)) if isinstance(self.mlp, MoE) else self.mlp(x))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 MTP module: h'_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]) -> decoder
    block -> shared_head.norm -> the main LM head gives logits for t_{i+2}. Embedding and head
    are shared with the main model (the checkpoint's copies are identical and skipped)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_ids: list[int] | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(cfg, layer_idx, expert_ids, quant_config, prefix)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, quant_config=quant_config,
                                        prefix=f"{prefix}.eh_proj")
        self.shared_head = SharedHead(cfg)

    def forward(self, h_prev: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h_prev)], dim=-1))
        rope = self.self_attn.rotary.cos_sin(positions, h.dtype)
        return self.shared_head.norm(super().forward(h, rope))

    def forward_rows(self, h_prev, next_embeds, positions, rows, rows_ctx):
        """forward() where only `rows` are wanted (paged path, drafting): every position writes
        its latent KV, attention, MLP and the head norm run for rows only (see
        MLAttention.forward_rows). rows None: the KV only; returns None."""
        h = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h_prev)], dim=-1))
        rope = self.self_attn.rotary.cos_sin(positions, h.dtype)
        attn = self.self_attn.forward_rows(self.input_layernorm(h), rope, rows, rows_ctx)
        if rows is None:
            return None
        h = h[rows] + attn
        return self.shared_head.norm(h + self.mlp(self.post_attention_layernorm(h)))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None, with_mtp: bool = True,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, expert_ids, quant_config, prefix=f"model.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + k, expert_ids, quant_config,
                                          prefix=f"model.mtp.{k}") for k in range(n_mtp))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.layers[0].self_attn.rotary.cos_sin(positions, h.dtype)  # same for every layer
        for layer in self.layers:
            h = layer(h, rope)
        return self.norm(h)

    def stages(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """forward() as a generator yielding while the MoE layers' exchanges fly (moe.py): the
        microbatch pipeline (worker/data_parallel.py) runs two of them in turn."""
        h = self.embed_tokens(input_ids)
        rope = self.layers[0].self_attn.rotary.cos_sin(positions, h.dtype)  # same for every layer
        for layer in self.layers:
            h = yield from layer.stages(h, rope)
        return self.norm(h)

    def idle_stages(self, dtype: torch.dtype, device):
        """What a rank (or microbatch) with no tokens runs: every MoE layer's exchanges with
        zero rows, in layer order, so its peers' collectives meet it."""
        x = torch.empty(0, self.norm.weight.shape[0], dtype=dtype, device=device)
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                yield from layer.mlp.stages(x)
        return x


class DeepseekForCausalLM(nn.Module):
    """input_ids/positions are [B, T] (dense path, no cache) or flat [N] under a ForwardContext
    (paged path). forward() returns the final hidden states; compute_logits() applies the head."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None, with_mtp: bool = True,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.config = cfg
        self.model = DeepseekModel(cfg, expert_ids, with_mtp, quant_config)
        self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size, quant_config=quant_config, prefix="lm_head",
                                        rows_repeat=True)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def mtp_forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, depth: int = 0):
        """Draft step of MTP module `depth`: hidden states h_i of the previous depth (the main
        model's final hidden states for depth 0), the tokens t_{i+1} and their positions i+1.
        Returns the module's hidden states; compute_logits() of them predicts t_{i+2}."""
        return self.model.mtp[depth](hidden, self.model.embed_tokens(next_ids), positions)

    def mtp_draft(self, hidden, next_ids, positions, rows=None, rows_ctx=None, depth: int = 0):
        """mtp_forward for drafting under a paged context: the MTP module's KV for every token,
        its hidden states only at `rows` (one per sequence, attending under rows_ctx)."""
        return self.model.mtp[depth].forward_rows(hidden, self.model.embed_tokens(next_ids), positions, rows, rows_ctx)

    @property
    def quantized(self) -> bool:
        """Whether any weight is stored in int8 (a W8A8 checkpoint)."""
        return any(p.dtype == torch.int8 for p in self.parameters())

    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers] + [m.self_attn for m in self.model.mtp]
