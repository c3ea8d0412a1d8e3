"""DeepSeekMoE: a router (grouped top-k with the aux-loss-free correction bias), routed
experts and always-on shared experts.

The routed experts held by this process may be a subset (expert parallelism): `experts`
(layers/experts.py) holds only those. Without a dispatcher they compute only their (token,
expert) pairs of this process's tokens; with expert parallelism (parallel/ep_comm.py) the tokens
travel to the ranks holding their experts and the weighted outputs come back. The router always
scores all experts; shared experts are replicated on every EP rank and run on the local tokens,
or (dedicated placement) run on their own ranks, reached through the same dispatch/combine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.kernels import small_mm
from matrixinfer.model.batch_invariant import sum_in_order
from matrixinfer.model.layers import MLP, QuantizationConfig, RoutedExperts
from matrixinfer.parallel.ep_comm import get_dispatcher
from matrixinfer.parallel.state import tp_all_reduce


class Router(nn.Module):
    batch_invariant = False  # model/batch_invariant.py: the gate through kernels.small_mm
    weight_small_mm = None  # its packed copy, where the mode is on (worker/model_runner.prepare_small_mm)

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
        if self.weight_small_mm is not None:
            logits = small_mm(x.float(), self.weight_small_mm)[:, : self.n_experts]
        else:
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
            grouped = choice.view(n, self.n_group, self.n_experts // self.n_group)  # n may be 0 (an idle EP rank)
            # noaux_tc ranks a group by its two best experts; group_limited_greedy by its best one
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if self.topk_method == "noaux_tc" else grouped.amax(-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n, self.n_experts)
            fill = float("-inf") if self.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~expert_mask, fill)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            total = (sum_in_order(weights, -1, keepdim=True) if self.batch_invariant
                     else weights.sum(dim=-1, keepdim=True))
            weights = weights / (total + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    """Router (replicated, float32) -> routed experts (local ones, intermediate dimension
    sharded over TP) + shared experts (an MLP sharded the same way). Both give partial sums,
    added before the block's one all-reduce."""

    def __init__(self, cfg: ModelConfig, expert_ids: list[int] | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, expert_ids,
                                     quant_config=quant_config, prefix=f"{prefix}.experts")
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, quant_config,
                prefix=f"{prefix}.shared_experts", reduce_results=False)
            if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_dispatcher() is not None:
            return run_stages(self.stages(x))
        # Without expert parallelism: plain code, not the generator, so that a compiled decode
        # step traces it into one graph (dynamo compiles generator frames piecewise).
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        return self._add_shared(self.experts(x, *self.gate(x)), x, shape)

    def stages(self, x: torch.Tensor):
        """forward() as a generator that yields while an expert-parallel exchange is in flight
        (after dispatch starts, after combine starts), so a microbatch pipeline can run the
        other microbatch there; it returns the block's output. Without a dispatcher it never yields."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        dispatcher = get_dispatcher()
        if dispatcher is None:
            return self._add_shared(self.experts(x, weights, ids), x, shape)
        dedicated = bool(dispatcher.shared_ranks) and self.shared_experts is not None
        pending = dispatcher.dispatch(x, weights, ids, self.experts, self.shared_experts if dedicated else None)
        yield
        dispatcher.compute(pending)
        yield
        out = dispatcher.combine(pending)
        if dedicated:  # the shared experts ran on their own ranks; combine brought them back
            return tp_all_reduce(out).view(shape)
        return self._add_shared(out, x, shape)

    def _add_shared(self, routed: torch.Tensor, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The routed experts' partial sum plus the (replicated) shared experts', all-reduced over TP."""
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return tp_all_reduce(routed).view(shape)


def run_stages(stages):
    """Run a stages() generator to its end (nothing to overlap with) and return its value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value
