"""The routed experts a process holds, as two stacked parameters for grouped matmuls:
w13_weight [E, 2I, H] (gate|up of each expert) and w2_weight [E, H, I].

Expert parallelism picks which experts (E = the local ones, `expert_ids`); tensor parallelism
splits every expert's intermediate dimension like a dense MLP (rank r holds rows
[r*I/T, (r+1)*I/T) of gate and of up, and those columns of down), so the output is a partial
sum: the MoE adds the shared experts' partial and all-reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from matrixinfer.kernels import AVX512, cpu_ops_serve, gemm_dtype
from matrixinfer.model.batch_invariant import sum_in_order
from matrixinfer.model.layers.linear import copy_shard
from matrixinfer.model.layers.quantization import UNQUANTIZED, QuantizationConfig
from matrixinfer.parallel.state import get_tp_rank, get_tp_size

PIECES = ("gate_proj", "up_proj", "down_proj")  # checkpoint names of an expert's projections
# Up to how many pairs per local expert (on average) the MoE runs the few-rows operator
# (kernels.small_mm) rather than ATen's grouped matmul (per-expert GEMMs), per dtype. As whole
# compiled decode steps (bundled model, float32): 1.42 vs 1.62 ms at 8 tokens, 2.66-2.80 vs
# 3.19-3.53 ms at 32. Per MoE layer (SwiGLU, both GEMMs), AMD EPYC Zen 4, bundled model (8 x
# 256 -> 192) / the 512 + 64 model (16 x 512 -> 256): float32 at 32 pairs per expert 597 vs 685
# us / 4.6 vs 7.1 ms, at 128 2.7 vs 2.2 ms / 14.5 vs 16.7 ms; bfloat16 at 32 357 vs 809 us /
# 2.0 vs 2.8 ms, at 64 3.7 vs 4.2 ms (the 512 + 64 model), at 128 1.3 vs 1.6 ms / 7.1 vs 6.7
# ms. So a 128-token prefill of the bundled model takes it too.
SMALL_MM_PAIRS_PER_EXPERT = {torch.float32: 32, torch.bfloat16: 64}


class RoutedExperts(nn.Module):
    batch_invariant = False  # model/batch_invariant.py: small_mm always, or one weighted sum on every path

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 expert_ids: list[int] | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", params_dtype: torch.dtype | None = None,
                 tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        if intermediate_size % self.tp_size:
            raise ValueError(f"{prefix}: moe_intermediate_size {intermediate_size} not divisible by tp {self.tp_size}")
        self.num_experts = num_experts
        self.expert_ids = list(range(num_experts)) if expert_ids is None else sorted(expert_ids)
        # global expert id -> local slot (-1: held elsewhere); a plain attribute built on the CPU
        # (not a buffer: the loader builds modules on the meta device)
        self.local_index = torch.full((num_experts,), -1, dtype=torch.long, device="cpu")
        self.local_index[self.expert_ids] = torch.arange(len(self.expert_ids), device="cpu")
        self.is_subset = len(self.expert_ids) < num_experts
        self.quant_method = (quant_config or UNQUANTIZED).get_experts_method(self, prefix)
        self.quant_method.create_weights(self, len(self.expert_ids), hidden_size, intermediate_size // self.tp_size,
                                         params_dtype or torch.get_default_dtype(), self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """shard_id = (global expert id, "gate_proj" | "up_proj" | "down_proj"): copy this rank's
        part of that expert's checkpoint tensor into its slot of the stacked parameter."""
        expert, piece = shard_id
        slot = int(self.local_index[expert]) if 0 <= expert < self.num_experts else -1
        if slot < 0:
            raise ValueError(f"expert {expert} is not held by this process (holds {self.expert_ids})")
        target = param.data[slot]  # one expert: the stacked dims shift down by one
        if piece == "down_proj":  # [H, I]: the intermediate dimension is the input
            dim = param.input_dim - 1 if hasattr(param, "input_dim") else None
        else:  # gate or up: its half of the [2I, H] output rows
            dim = param.output_dim - 1
            half = target.shape[dim] // 2
            target = target.narrow(dim, PIECES.index(piece) * half, half)
        copy_shard(target, loaded_weight, dim, self.tp_rank, self.tp_size)

    def local_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids (-1: none) -> local slots, -1 where the expert is held elsewhere."""
        if self.local_index.device != ids.device:
            self.local_index = self.local_index.to(ids.device)
        return torch.where(ids >= 0, self.local_index[ids.clamp_min(0)], -1)

    def path(self, num_tokens: int, top_k: int, device: torch.device | None = None,
             dtype: torch.dtype | None = None) -> str:
        """How a batch runs, chosen from shapes alone (so a compiled decode step has no graph
        break), in the order tried:
        - "small_mm" (the CPU operator) at a few pairs per expert (SMALL_MM_PAIRS_PER_EXPERT):
          it buckets the pairs by expert itself and reads each active expert's weights once.
          float32 with AVX-512 keeps "pairs" at one or two tokens, where the compiled step fuses
          the gather, multiply and sum into one kernel (0.66 vs 0.72 ms a step at batch 1); in
          bfloat16, or with AVX2, small_mm wins there too (1.49 vs 1.56 ms on the 512 + 64
          model in bfloat16).
        - "pairs" gathers each pair's expert weights when that reads fewer weights than running
          every local expert.
        - "grouped_mm" groups the pairs by expert on the device and runs one grouped matmul
          (no host sync; on the CPU, with the weights unquantized) from four pairs per expert.
          Measured per MoE layer at 32 tokens: 0.25 vs 0.37 ms for "all" (8 experts, top-2,
          float32), 1.8 vs 3.0 ms (16 experts, top-4, bfloat16).
        - "all" runs every local expert on every token when that costs at most 4x the routed
          work; "grouped" groups pairs by expert (one host sync on the counts, the path of
          large batches)."""
        n_local = len(self.expert_ids)
        pairs = not self.is_subset and 2 * num_tokens * top_k <= n_local
        serves = device is not None and self.quant_method.small_mm_serves(self, dtype, device)
        if self.batch_invariant and serves and not self.is_subset:
            return "small_mm"
        small = (not self.is_subset and num_tokens * top_k <= SMALL_MM_PAIRS_PER_EXPERT.get(dtype, 0) * n_local
                 and serves)
        if small and not (pairs and dtype == torch.float32 and AVX512):
            return "small_mm"
        if pairs:
            return "pairs"
        if (not self.is_subset and num_tokens * top_k >= 4 * n_local and self.quant_method.grouped_mm_serves(self)
                and device is not None and cpu_ops_serve(device)):
            return "grouped_mm"
        return "all" if n_local <= 4 * top_k else "grouped"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x [N, H], routing weights/ids [N, top_k] -> this rank's partial sum [N, H] of the
        weighted outputs of the local experts (pairs routed elsewhere contribute nothing)."""
        n, k = ids.shape
        if self.local_index.device != ids.device:
            self.local_index = self.local_index.to(ids.device)
        path = path or self.path(n, k, x.device, x.dtype)
        if path == "grouped_mm":
            return self._grouped(x, weights, ids, sync_free=True)
        if path == "small_mm":  # the operator buckets the pairs by expert itself
            y = self.quant_method.apply_small_mm(self, x.repeat_interleave(k, dim=0), self.local_index[ids.flatten()])
            return _weighted_sum(y, weights, self.batch_invariant)
        if path == "pairs":
            y = self.quant_method.apply_pairs(self, x, self.local_index[ids])
            if y is not None and self.batch_invariant:  # the grouped path's weighted sum (W8A8: equal pair outputs)
                return _weighted_sum(y.flatten(0, 1), weights, True)
            if y is not None:
                ct = gemm_dtype(x.dtype, x.device)
                return torch.einsum("nk,nkh->nh", weights.to(ct), y.to(ct)).to(x.dtype)
        elif path == "all":
            y = self.quant_method.apply_all(self, x)
            if y is not None and self.batch_invariant and not self.is_subset:  # each pair's row, summed as above
                local = self.local_index[ids]
                return _weighted_sum(y[local.flatten(), torch.arange(n, device=x.device).repeat_interleave(k)], weights,
                                     True)
            if y is not None:
                n_local, local = len(self.expert_ids), self.local_index[ids]
                combine = weights.new_zeros(n, n_local + 1)  # column n_local collects pairs held elsewhere
                combine.scatter_add_(1, torch.where(local >= 0, local, n_local), weights)
                ct = gemm_dtype(x.dtype, x.device)
                return torch.einsum("ne,enh->nh", combine[:, :n_local].to(ct), y.to(ct)).to(x.dtype)
        return self._grouped(x, weights, ids)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, sync_free: bool = False) -> torch.Tensor:
        """Pairs grouped by expert, each group through its expert. sync_free (every expert local,
        path "grouped_mm"): one grouped matmul with the group ends on the device; otherwise the
        quant method's apply, which reads the counts on the host. Counted by a scatter: a static
        shape, where bincount's depends on the data."""
        k, n_local = ids.shape[1], len(self.expert_ids)
        local = self.local_index[ids.flatten()]
        pair = torch.nonzero(local >= 0).flatten() if self.is_subset else torch.arange(local.numel(), device=x.device)
        local = local[pair]
        order = local.argsort(stable=True)  # group pairs by expert
        pair, local = pair[order], local[order]
        token_idx = pair // k
        counts = torch.zeros(n_local, dtype=torch.long, device=x.device).index_add_(0, local, torch.ones_like(local))
        if sync_free:
            y = self.quant_method.apply_grouped_mm(self, x[token_idx], counts.cumsum(0).to(torch.int32))
        else:
            y = self.quant_method.apply(self, x[token_idx], local, counts)
        if self.is_subset:  # some pairs are held elsewhere: add the rows present into their tokens
            y = y * weights.flatten()[pair, None].to(x.dtype)
            return torch.zeros_like(x).index_add_(0, token_idx, y)
        # every pair is here: the rows back in pair order by a gather, then each token's top_k
        # rows weighted and summed. A scatter-add compiles to an atomic add per element (74 of
        # the 90 us this combine took at 32 tokens in a compiled step); a gather vectorises.
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=x.device)
        return _weighted_sum(y[unsort], weights, self.batch_invariant)


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor, in_order: bool = False) -> torch.Tensor:
    """y [N * top_k, H], rows in pair order (token-major), weights [N, top_k] -> [N, H]: each
    token's rows weighted and summed, as one elementwise-and-reduce the compiler fuses.
    in_order (batch-invariant mode): the top_k terms added one after another, an order no
    graph's shapes can change (a compiled reduction picks its own)."""
    terms = y.view(*weights.shape, y.shape[-1]) * weights[..., None].to(y.dtype)
    return sum_in_order(terms, 1) if in_order else terms.sum(1)
