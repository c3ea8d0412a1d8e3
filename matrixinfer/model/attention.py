"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3.

The cache holds, per token and layer, only the compressed latent c_kv (kv_lora_rank, after
its RMSNorm) and the shared rope key k_pe (qk_rope_head_dim): never per-head K/V.

Two ways to attend, which agree (tests check it):
- unabsorbed (prefill): up-project the latents of the sequence to per-head K/V with kv_b_proj
  and run ordinary causal attention. Cheaper when many queries share one up-projection.
- absorbed (decode): fold kv_b_proj into the query and the output, so attention runs
  directly over the latents: q_lat = q_nope @ W_UK, score = q_lat.c_kv + q_pe.k_pe,
  out = (softmax @ c_kv) @ W_UV^T. Each decode step reads kv_lora_rank + rope dims per token.

Tensor parallelism splits the heads: q_b_proj (q_proj without q_lora) and kv_b_proj are
column-parallel, so each rank computes its `n_heads` = heads / T local heads on both paths;
o_proj is row-parallel and all-reduces the block's output. The latent projection (q_a|kv_a)
is replicated and every rank keeps the whole latent cache (it is shared by all heads).

SP-TP-SP (the paper's prefill, parallel/sequence.py) runs the three stages on different
cuts of the tokens: stage 1 (`down`: the latent down-projections, their norms, the key's RoPE)
on this rank's slice of the step's tokens; one all-gather of its output (q latent | c_kv |
k_pe per token); stage 2 (`up_q`, the cache write and attention) on every token for this
rank's heads, each sequence attended causally in whole; stage 3 (o_proj, row-parallel over
the heads) as a partial sum for every token, reduce-scattered back to the token slices.
Every rank writes every token's latents, so each holds the whole latent cache, as under TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.kernels import cpu_ops_serve, gemm_dtype, pack_small_mm, paged_mla_decode, small_mm
from matrixinfer.model.context import ForwardContext, get_context
from matrixinfer.model.layers import (
    ColumnParallelLinear,
    MergedReplicatedLinear,
    QuantizationConfig,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from matrixinfer.model.moe import run_stages
from matrixinfer.parallel.state import get_head_group, get_sp_group


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     causal_offset: int = 0) -> torch.Tensor:
    """q [..., H, Tq, d] over k, v [..., H, Tk, d], Tk = causal_offset + Tq, each query seeing
    the keys up to its own position."""
    if causal_offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    tq, tk = q.shape[-2], k.shape[-2]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=causal_offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.library.custom_op("matrixinfer::varlen_causal_attention", mutates_args=())
def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """q, k, v [T, H, d]: the tokens of several sequences one after another, sequence i's rows
    cu_seqlens[i]:cu_seqlens[i + 1]; each attends causally within its own sequence. An operator
    (opaque to the compiler) so that a compiled prefill step runs the varying per-sequence
    loop eagerly, with no guards on the sequence lengths."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        # [1, H, T, d]: PyTorch's CPU flash kernel takes 4-d inputs only (3-d ones fall back to
        # the math path: 5.5 vs 1.5 ms at 512 tokens, 4 heads of 48)
        out[a:b] = causal_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), scale)[0].transpose(0, 1)
    return out


@varlen_causal_attention.register_fake
def _(q, k, v, cu_seqlens, scale):
    return torch.empty_like(q)


class MLAttention(nn.Module):
    batch_invariant = False  # model/batch_invariant.py: the absorbed products packed in float32 too

    def __init__(self, cfg: ModelConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        self.layer_idx = layer_idx
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        self.scale = cfg.softmax_scale
        h = cfg.hidden_size
        heads = get_head_group()  # the TP group, or the SP group under SP-TP-SP
        tp = heads.size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {cfg.num_attention_heads} not divisible by tp size {tp}")
        self.n_heads = cfg.num_attention_heads // tp  # this rank's heads
        self.sequence_parallel = get_sp_group().size > 1
        n = cfg.num_attention_heads
        kw = dict(quant_config=quant_config)
        split = dict(kw, tp_rank=heads.rank, tp_size=heads.size)  # the head-split layers
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            # q reads x directly: column-parallel (a replicated q|kv_a would compute every head on every rank)
            self.q_proj = ColumnParallelLinear(h, n * self.qk_dim, prefix=f"{prefix}.q_proj", **split)
            self.kv_a_proj_with_mqa = ReplicatedLinear(h, kv_a, prefix=f"{prefix}.kv_a_proj_with_mqa", **kw)
        else:
            # the two latent down-projections read x: one replicated matmul
            self.fused_qkv_a_proj = MergedReplicatedLinear(h, [cfg.q_lora_rank, kv_a],
                                                           prefix=f"{prefix}.fused_qkv_a_proj", **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, n * self.qk_dim, prefix=f"{prefix}.q_b_proj",
                                                 **split)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, n * (self.nope_dim + self.v_dim),
                                              prefix=f"{prefix}.kv_b_proj", **split)
        # under SP-TP-SP o_proj's partial sums are reduce-scattered by stages(), not all-reduced
        self.o_proj = RowParallelLinear(n * self.v_dim, h, prefix=f"{prefix}.o_proj",
                                        reduce_results=not self.sequence_parallel, **split)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_lora_rank + rope], set by the engine
        # W_UK^T [H, rank, nope] and W_UV [H, v, rank], each head an "expert", packed for the
        # few-rows operator (kernels.pack_small_mm), set by prepare_absorbed(); None: einsum over views
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare_absorbed(self) -> None:
        """After the weights load, on the CPU, in bfloat16: the absorbed decode's two per-head
        products read copies packed for kernels.small_mm (each head an "expert"), as vLLM keeps
        W_UK^T and W_UV. The einsums over kv_b_proj's views made the BLAS copy both every call
        (16 copies of 1 MB per step, 0.47 ms, on the 512 + 64 model at 8 sequences, besides 0.73
        ms of bmm; the forward went from 6.46 to 4.97 ms). Not in float32: there the copies are
        cheap and the BLAS level with the operator at 8 sequences, ahead at 32 (3.0 vs 3.1 ms)."""
        w_uk, w_uv = self._w_uk_uv()
        if w_uk.dtype == torch.bfloat16 or self.batch_invariant:
            w_uk_t, w_uv = pack_small_mm(w_uk.transpose(1, 2)), pack_small_mm(w_uv)
            self.absorbed = (w_uk_t, w_uv) if w_uk_t is not None and w_uv is not None else None

    # -- the "MLA prolog": projections, norm, rope --------------------------------------------
    def prolog(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x: [..., hidden], rope: (cos, sin) of the positions ->
        q_nope [..., H, nope], q_pe [..., H, rope], c_kv [..., rank], k_pe [..., rope]."""
        q_in, c_kv, k_pe = self.down(x, rope)
        return (*self.up_q(q_in, rope), c_kv, k_pe)

    def down(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Stage 1, per token: -> q_in (the normalised q latent; x itself without q_lora),
        c_kv (normalised), k_pe (roped)."""
        if self.q_lora_rank is None:
            q_in, kv = x, self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv = self.fused_qkv_a_proj(x).split(self.fused_qkv_a_proj.output_sizes, dim=-1)
            q_in = self.q_a_layernorm(q_a)
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = rope
        return q_in, self.kv_a_layernorm(c_kv), self.rotary(k_pe.unsqueeze(-2), cos, sin).squeeze(-2)

    def up_q(self, q_in: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Stage 2's query up-projection to this rank's heads: -> q_nope, q_pe (roped)."""
        q = (self.q_proj if self.q_lora_rank is None else self.q_b_proj)(q_in)
        q = q.view(*q_in.shape[:-1], self.n_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        cos, sin = rope
        return q_nope, self.rotary(q_pe, cos, sin)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.sequence_parallel:
            return run_stages(self.stages(x, rope))
        q_nope, q_pe, c_kv, k_pe = self.prolog(x, rope)
        ctx = get_context()
        if ctx is None:
            out = self._attend_unabsorbed(q_nope, q_pe, c_kv, k_pe, causal_offset=0)
        else:
            out = self._forward_paged(ctx, q_nope, q_pe, c_kv, k_pe)
        return self.o_proj(out.flatten(-2))

    def stages(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """The SP-TP-SP forward as a generator that yields while the all-gather and the
        reduce-scatter fly (a microbatch pipeline runs the other microbatch there)."""
        ctx = get_context()
        sp = ctx.sp if ctx is not None else None
        if sp is None:
            raise RuntimeError("a sequence-parallel attention layer runs under a ForwardContext with sequence shards")
        # stage 1 on this rank's tokens; x is [sizes[rank], hidden]
        q_in, c_kv, k_pe = self.down(x, rope)
        pieces = [q_in.shape[-1], self.kv_lora_rank, self.rope_dim]
        handle = sp.start_gather(torch.cat([q_in, c_kv, k_pe], dim=-1))
        yield
        q_in, c_kv, k_pe = sp.finish_gather(handle).split(pieces, dim=-1)
        # stage 2 on every token, this rank's heads
        q_nope, q_pe = self.up_q(q_in, sp.rope(self.rotary, x.dtype))
        out = self._forward_paged(ctx, q_nope, q_pe, c_kv, k_pe)
        # stage 3: o_proj's partial sum over this rank's heads, summed into the token slices
        handle = sp.start_scatter(self.o_proj(out.flatten(-2)))
        yield
        return sp.finish_scatter(handle)

    # -- weights folded for the absorbed path --------------------------------------------------
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, rank], [H, v, rank]

    def _qkv_unabsorbed(self, q_nope, q_pe, c_kv, k_pe):
        """The latents up-projected to per-head keys and values: q_*: [..., Tq, H, *]; c_kv/k_pe:
        [..., Tk, *] -> q [..., Tq, H, d], k and v [..., Tk, H, d], d = qk_head_dim. v is padded
        with zeros to d: PyTorch's fused (flash) kernels need one head size for all three and
        otherwise fall back to the math path (measured on the CPU, 4 heads of 48/32: 114 vs 219
        us at 128 tokens, 1.1 vs 5.5 ms at 512)."""
        kv = self.kv_b_proj(c_kv).view(*c_kv.shape[:-1], self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1]))

    def _attend_unabsorbed(self, q_nope, q_pe, c_kv, k_pe, causal_offset: int) -> torch.Tensor:
        """q_*: [B, Tq, H, *]; c_kv/k_pe: [B, Tk, *] with Tk = causal_offset + Tq. Returns [B, Tq, H, v]."""
        q, k, v = (t.transpose(-3, -2) for t in self._qkv_unabsorbed(q_nope, q_pe, c_kv, k_pe))  # [B, H, T, d]
        out = causal_attention(q, k, v, self.scale, causal_offset)
        return out[..., : self.v_dim].transpose(-3, -2)

    def _attend_fresh(self, ctx: ForwardContext, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        """Every sequence of the step is a whole new prompt (ForwardContext.prompt_cu_seqlens):
        its keys are the step's own latents, so attention needs no read of the cache and no
        per-sequence Python, and a compiled prefill step traces it. [T, H, *] -> [T, H, v]."""
        q, k, v = self._qkv_unabsorbed(q_nope, q_pe, c_kv, k_pe)
        return varlen_causal_attention(q, k, v, ctx.prompt_cu_seqlens, self.scale)[..., : self.v_dim]

    def _attend_paged(self, q_nope, q_pe, cache, block_tables, lens) -> torch.Tensor:
        """One query per sequence over its latents in the paged cache: [S, H, *] -> [S, H, v].
        On the CPU a kernel reads the latents where they lie (kernels/cpu_ops.cpp);
        elsewhere they are gathered into [S, T, rank + rope] first."""
        if cpu_ops_serve(cache.device):
            return self._attend_absorbed(q_nope, q_pe, None, lens, (cache, block_tables))
        return self._attend_absorbed(q_nope, q_pe, cache[block_tables].flatten(1, 2), lens)

    def _attend_absorbed(self, q_nope, q_pe, latents, lens, paged=None) -> torch.Tensor:
        """q_*: [S, H, *] one query per sequence; latents: [S, T, rank + rope]; lens: [S]. Returns [S, H, v].
        Several queries per sequence (speculative verification): q_* [S, Q, H, *] and lens [S, Q],
        the keys each query sees; the queries are folded into the head dimension. Returns [S, Q, H, v].
        paged = (cache, block_tables) instead of latents: the paged kernel attends (one query each)."""
        if q_nope.dim() == 4:
            s, nq, h = q_nope.shape[:3]
            out = self._attend_absorbed(q_nope.flatten(1, 2), q_pe.flatten(1, 2), latents,
                                        lens.repeat_interleave(h, dim=1))
            return out.unflatten(1, (nq, h))
        if self.absorbed is not None and q_nope.dtype == self.absorbed[0].dtype:
            w_uk_t, w_uv = self.absorbed
            s, h = q_nope.shape[:2]  # h: the heads, or queries x heads when folded
            head = (torch.arange(h, device=q_nope.device) % self.n_heads).repeat(s)  # each row's head
            q_lat = small_mm(q_nope.reshape(s * h, -1), w_uk_t, head).view(s, h, -1)
            q = torch.cat([q_lat, q_pe], dim=-1)
            if paged is not None:
                o_lat = paged_mla_decode(q, paged[0], paged[1], lens, self.scale, self.kv_lora_rank)
            else:
                o_lat = self._attend_latents(q, latents, lens)
            return small_mm(o_lat.reshape(s * h, -1), w_uv, head).view(s, h, -1)
        w_uk, w_uv = self._w_uk_uv()
        if q_nope.shape[1] != self.n_heads:  # queries folded into heads
            w_uk, w_uv = (w.repeat(q_nope.shape[1] // self.n_heads, 1, 1) for w in (w_uk, w_uv))
        ct = gemm_dtype(q_nope.dtype, q_nope.device)
        q_lat = torch.einsum("shd,hdr->shr", q_nope.to(ct), w_uk.to(ct)).to(q_nope.dtype)
        q = torch.cat([q_lat, q_pe], dim=-1)  # [S, H, rank + rope]
        if paged is not None:
            o_lat = paged_mla_decode(q, paged[0], paged[1], lens, self.scale, self.kv_lora_rank)
        else:
            o_lat = self._attend_latents(q, latents, lens)
        return torch.einsum("shr,hvr->shv", o_lat.to(ct), w_uv.to(ct)).to(q_nope.dtype)

    def _attend_latents(self, q: torch.Tensor, latents: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """q [S, H, rank + rope] over gathered latents [S, T, rank + rope], the first lens [S]
        (or [S, H]) of each -> o_lat [S, H, rank]."""
        ct = gemm_dtype(q.dtype, q.device)
        scores = torch.bmm(q.to(ct), latents.to(ct).transpose(1, 2)).float() * self.scale  # [S, H, T]
        valid = torch.arange(latents.shape[1], device=q.device)[None, :] < lens[..., None]  # [S, T] or [S, H, T]
        scores = scores.masked_fill(~valid[:, None, :] if lens.dim() == 1 else ~valid, float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype)
        return torch.bmm(probs.to(ct), latents[..., : self.kv_lora_rank].to(ct)).to(q.dtype)  # [S, H, rank]

    def forward_rows(self, x: torch.Tensor, rope, rows: torch.Tensor | None,
                     rows_ctx: ForwardContext | None) -> torch.Tensor | None:
        """Write the latent KV of every token of x (at the current context's slots), but attend
        only for `rows`, one query each under rows_ctx (a decode context over the same cache):
        the MTP module drafts from one row per sequence and needs the other rows' KV only.
        rows None: write the KV, attend for nothing."""
        q_nope, q_pe, c_kv, k_pe = self.prolog(x, rope)
        self._write_kv(get_context().slot_mapping, c_kv, k_pe)
        if rows is None:
            return None
        with_rows = self._forward_paged(rows_ctx, q_nope[rows], q_pe[rows], c_kv[rows], k_pe[rows])
        return self.o_proj(with_rows.flatten(-2))

    # -- paged path -----------------------------------------------------------------------------
    def _write_kv(self, slot_mapping: torch.Tensor, c_kv, k_pe) -> None:
        """cache [blocks, block_size, D] <- the new tokens' latents at their flat slots. Indexed
        by (block, offset), not through a flattened view: a compiled step then writes the slots
        in place, where a mutation through a view of a graph input copies the whole cache."""
        bs = self.kv_cache.shape[1]
        self.kv_cache[slot_mapping // bs, slot_mapping % bs] = torch.cat([c_kv, k_pe], dim=-1).to(self.kv_cache.dtype)

    def _forward_paged(self, ctx: ForwardContext, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        cache = self.kv_cache
        self._write_kv(ctx.slot_mapping, c_kv, k_pe)
        if ctx.decode_only:
            # Every sequence has one new token: shapes come from the tensors alone (the block
            # table is padded by the runner), so this path has no host syncs and compiles once.
            return self._attend_paged(q_nope, q_pe, cache, ctx.block_tables, ctx.context_lens_tensor)
        if ctx.prompt_cu_seqlens is not None and c_kv.dtype == cache.dtype:  # the cache holds c_kv as it is
            return self._attend_fresh(ctx, q_nope, q_pe, c_kv, k_pe)
        out = q_nope.new_empty(q_nope.shape[0], self.n_heads, self.v_dim)
        nd = ctx.num_decode_seqs
        if nd:
            tables = ctx.block_tables[:nd]
            max_len = max(ctx.context_lens[:nd])
            n_blocks = -(-max_len // cache.shape[1])
            if ctx.decode_query_len == 1:
                out[:nd] = self._attend_paged(q_nope[:nd], q_pe[:nd], cache, tables[:, :n_blocks],
                                              ctx.context_lens_tensor[:nd])
            else:  # k + 1 queries per sequence (speculative verification), causal among themselves
                latents = cache[tables[:, :n_blocks]].flatten(1, 2)  # [S, n_blocks*block_size, D]
                pad, nt = ctx.decode_pad_index, ctx.num_decode_tokens
                qn, qp = (q_nope[:nt], q_pe[:nt]) if pad is None else (q_nope[pad], q_pe[pad])
                o = self._attend_absorbed(qn.unflatten(0, (nd, -1)), qp.unflatten(0, (nd, -1)), latents,
                                          ctx.decode_lens).flatten(0, 1)
                out[:nt] = o if pad is None else o[ctx.decode_unpad_index]
        start = ctx.num_decode_tokens
        for i in range(nd, len(ctx.query_lens)):
            q_len, ctx_len = ctx.query_lens[i], ctx.context_lens[i]
            n_blocks = -(-ctx_len // cache.shape[1])
            seq_latents = cache[ctx.block_tables[i, :n_blocks]].flatten(0, 1)[:ctx_len]
            sl = slice(start, start + q_len)
            out[sl] = self._attend_unabsorbed(
                q_nope[sl][None], q_pe[sl][None],
                seq_latents[None, :, : self.kv_lora_rank], seq_latents[None, :, self.kv_lora_rank :],
                causal_offset=ctx_len - q_len,
            )[0]
            start += q_len
        return out
