"""The DeepSeek-V3 family (also V2) as plain PyTorch: decoder layers, the model, the LM head
and the multi-token-prediction (MTP) module. Parameter names equal the Hugging Face
checkpoint names, so loading is a name-for-name copy.
"""

from __future__ import annotations

import torch
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.model.attention import MLAttention
from matrixinfer.model.layers import MLP, RMSNorm
from matrixinfer.model.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_ids: list[int] | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx)
        self.mlp = MoE(cfg, expert_ids) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 MTP module: h'_i = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]) -> decoder
    block -> shared_head.norm -> the main LM head gives logits for t_{i+2}. Embedding and head
    are shared with the main model (the checkpoint's copies are identical and skipped)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_ids: list[int] | None = None):
        super().__init__(cfg, layer_idx, expert_ids)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, h_prev: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(h_prev)], dim=-1))
        rope = self.self_attn.rotary.cos_sin(positions, h.dtype)
        return self.shared_head.norm(super().forward(h, rope))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None, with_mtp: bool = True):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, expert_ids) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n_mtp = cfg.num_nextn_predict_layers if with_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_hidden_layers + k, expert_ids) for k in range(n_mtp))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.layers[0].self_attn.rotary.cos_sin(positions, h.dtype)  # same for every layer
        for layer in self.layers:
            h = layer(h, rope)
        return self.norm(h)


class DeepseekForCausalLM(nn.Module):
    """input_ids/positions are [B, T] (dense path, no cache) or flat [N] under a ForwardContext
    (paged path). forward() returns the final hidden states; compute_logits() applies the head."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None, with_mtp: bool = True):
        super().__init__()
        self.config = cfg
        self.model = DeepseekModel(cfg, expert_ids, with_mtp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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

    def pack_weights(self) -> "DeepseekForCausalLM":
        """For inference: fuse projections that read the same input and stack the experts
        (parameters become views; names and memory unchanged). Call after the final
        .to(device/dtype): moving the model afterwards would break the views."""
        for module in self.modules():
            if isinstance(module, (MLAttention, MoE)) or (isinstance(module, MLP) and module.gate_up is None):
                module.pack()
        return self

    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers] + [m.self_attn for m in self.model.mtp]
