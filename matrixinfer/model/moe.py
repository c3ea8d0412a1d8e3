"""DeepSeekMoE: a router (grouped top-k with the aux-loss-free correction bias), routed
experts and always-on shared experts.

The routed experts held by this process may be a subset (expert parallelism): `experts` maps
global expert id -> MLP, and `forward_local` computes only the local ones. The router always
scores all experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.model.layers import MLP


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.topk_method, self.scoring_func = cfg.topk_method, cfg.scoring_func
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        # The gate stays float32 whatever the model dtype: routing decisions are sensitive.
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        if self.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.weight.float())
        return logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (weights [N, top_k] float32, expert ids [N, top_k])."""
        scores = self.scores(x)
        if self.topk_method == "greedy":
            choice = scores
        else:
            n = scores.shape[0]
            choice = scores + self.e_score_correction_bias if self.topk_method == "noaux_tc" else scores
            grouped = choice.view(n, self.n_group, -1)
            # noaux_tc ranks a group by its two best experts; group_limited_greedy by its best one
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if self.topk_method == "noaux_tc" else grouped.amax(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, -1)
            fill = float("-inf") if self.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~expert_mask, fill)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None):
        super().__init__()
        self.gate = Router(cfg)
        ids = list(range(cfg.n_routed_experts)) if expert_ids is None else sorted(expert_ids)
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size) for e in ids})
        # global expert id -> local slot (-1: held elsewhere); a plain attribute built on the CPU
        # (not a buffer: the loader builds modules on the meta device)
        self.local_index = torch.full((cfg.n_routed_experts,), -1, dtype=torch.long, device="cpu")
        self.local_index[ids] = torch.arange(len(ids), device="cpu")
        self.is_subset = len(ids) < cfg.n_routed_experts
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        self.w13: torch.Tensor | None = None  # [local experts, 2I, H] after pack()
        self.w2: torch.Tensor | None = None  # [local experts, H, I]

    def pack(self) -> None:
        """Stack the local experts' weights (gate|up and down) into two [E, ...] tensors, with
        every expert's parameters becoming views into them, for grouped expert matmuls."""
        experts = list(self.experts.values())
        w = experts[0].gate_proj.weight
        i, h = w.shape
        self.w13 = w.new_empty(len(experts), 2 * i, h)
        self.w2 = w.new_empty(len(experts), h, i)
        for e, mlp in enumerate(experts):
            mlp.pack(out=self.w13[e])
            self.w2[e].copy_(mlp.down_proj.weight.data)
            mlp.down_proj.weight.data = self.w2[e]
        if self.shared_experts is not None:
            self.shared_experts.pack()

    def forward_local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the local experts' outputs for the (token, expert) pairs routed to
        them (pairs routed to experts held elsewhere contribute nothing here)."""
        k = ids.shape[1]
        if self.local_index.device != ids.device:
            self.local_index = self.local_index.to(ids.device)
        local = self.local_index[ids.flatten()]
        pair = torch.nonzero(local >= 0).flatten() if self.is_subset else torch.arange(local.numel(), device=x.device)
        local = local[pair]
        order = local.argsort(stable=True)  # group pairs by expert
        pair, local = pair[order], local[order]
        token_idx = pair // k
        xs = x[token_idx]
        counts = torch.bincount(local, minlength=len(self.experts))
        if self.w13 is None:
            ys = [mlp(chunk) for mlp, chunk in zip(self.experts.values(), xs.split(counts.tolist())) if chunk.numel()]
            y = torch.cat(ys) if ys else xs
        else:
            y = self._grouped_experts(xs, local, counts)
        y = y * weights.flatten()[pair, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_idx, y)

    def _grouped_experts(self, xs: torch.Tensor, local: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """All experts at once: pairs padded to [E, max count, H] and two batched matmuls.
        When padding would more than double the work (large, skewed batches) experts run one
        by one on their slices instead."""
        n_exp, max_count = counts.numel(), int(counts.max()) if xs.shape[0] else 0
        if n_exp * max_count > 2 * xs.shape[0]:
            ys = []
            for e, chunk in enumerate(xs.split(counts.tolist())):
                if chunk.numel():
                    gate, up = F.linear(chunk, self.w13[e]).chunk(2, dim=-1)
                    ys.append(F.linear(F.silu(gate) * up, self.w2[e]))
            return torch.cat(ys) if ys else xs
        offsets = torch.cumsum(counts, 0) - counts
        pos = torch.arange(xs.shape[0], device=xs.device) - offsets[local]
        padded = xs.new_zeros(n_exp, max_count, xs.shape[-1])
        padded[local, pos] = xs
        gate, up = torch.bmm(padded, self.w13.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.w2.transpose(1, 2))
        return out[local, pos]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        out = self.forward_local(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
