"""Pipelined MTP speculative decoding, the worker's half: verify, accept, draft, in one step.

A step's tokens run through the target model once. For every request that speculates
(ScheduledRequest.spec), the rows that verify are its last token and its drafts (a decode
row) or the last token of its prompt (the chunk that finishes it). Acceptance runs on the
device: the drafts are greedy proposals (argmax of the MTP logits, a one-hot q), so rejection
sampling (Leviathan et al.) accepts draft d with probability p(d) and, at the first rejection,
samples from p with d removed, renormalised; after k acceptances a bonus token is sampled
from the last row. The output is distributed exactly as the target's p (after temperature,
top-k, top-p, min-p); a greedy row has a one-hot p, so it is token-identical to decoding
without speculation.

Drafting follows in the same step, without reading anything back: the MTP module reads, at
every position i of the step, the target's final hidden state h_i and the token now known to
follow (the next prompt token, or the target's own token at that row), writing its own latent
KV at slot i (its attention layer has its own slice of the paged cache). The draft of a
request is the MTP logits' argmax at its last accepted row, found by a device-side gather;
k > 1 runs the MTP layer again on its own hidden state and draft, one position further, as
vLLM does. All the metadata (row indices, sampling parameters, random numbers) is built on
the host at step start; one transfer at the end brings back tokens, accepted counts and drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.kernels import argmax_rows
from matrixinfer.model.context import ForwardContext


@dataclass
class SpecBatch:
    """What one step's verification and drafting need, on the device. R verify rows, S
    speculating requests (in batch order)."""
    rows: torch.Tensor  # [R] flat token index of each verify row
    row_draft: torch.Tensor  # [R] the draft the row's token is checked against; -1: bonus row
    row_pos: torch.Tensor  # [R] the row's place among its request's rows
    row_req: torch.Tensor  # [R] its request (0..S-1)
    req_rows: torch.Tensor  # [S, K+1] each request's rows, padded with its bonus row
    first_token: torch.Tensor  # [S] flat token index of each request's first verify row
    req_index: torch.Tensor  # [S] each request's place in the step's batch
    shifted_ids: torch.Tensor  # [tokens] the token after each token where the host knows it
    greedy_only: bool
    temperature: torch.Tensor | None = None  # [R], 1 on greedy rows
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None  # None: no row uses it
    truncate: bool = False  # some row filters by top-k / top-p / min-p
    greedy: torch.Tensor | None = None  # [R] bool
    uniform: torch.Tensor | None = None  # [R] acceptance draws
    noise: torch.Tensor | None = None  # [R, V] Exp(1) for the exponential race
    # host side: where each request's rows start among the R, and how many it has
    row_start: tuple[int, ...] = ()
    num_rows: tuple[int, ...] = ()
    host_req_index: tuple[int, ...] = ()
    plain_rows: torch.Tensor | None = None  # flat token index of the sampling rows that do not speculate

    @classmethod
    def build(cls, reqs: list[ScheduledRequest], vocab_size: int, device: torch.device, generators) -> "SpecBatch":
        """generators(r) -> the request's seeded CPU generator or None."""
        rows, draft, pos, req, req_index, first, shifted, plain = [], [], [], [], [], [], [], []
        row_start, num_rows, params, seeded = [], [], [], []
        off = 0
        for i, r in enumerate(reqs):
            n = len(r.token_ids)
            shifted += r.token_ids[1:] + [r.next_token_id if r.next_token_id is not None else 0]
            if r.spec:
                q = 1 + r.num_draft  # the last token's row, then one per draft
                s = len(req_index)
                row_start.append(len(rows)), num_rows.append(q), req_index.append(i), first.append(off + n - q)
                rows += range(off + n - q, off + n)
                draft += r.token_ids[n - q + 1:] + [-1]
                pos += range(q)
                req += [s] * q
                params += [r.params] * q
                seeded += [(len(rows) - q, q, generators(r))]
            elif r.sample:
                plain.append(off + n - 1)
            off += n
        kmax = max(num_rows, default=1)
        req_rows = [row_start[s] + min(j, num_rows[s] - 1) for s in range(len(num_rows)) for j in range(kmax)]
        # one host-to-device copy for all the index lists
        parts = [rows, draft, pos, req, req_rows, first, req_index, shifted, plain]
        rows_, draft_, pos_, req_, req_rows_, first_, index_, shifted_, plain_ = torch.tensor(
            [x for part in parts for x in part], dtype=torch.long, device=device).split([len(x) for x in parts])
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        b = cls(rows_, draft_, pos_, req_, req_rows_.view(len(num_rows), kmax), first_, index_, shifted_,
                all(p.greedy for p in params), row_start=tuple(row_start), num_rows=tuple(num_rows),
                host_req_index=tuple(req_index), plain_rows=plain_)
        if not b.greedy_only:
            b.temperature = t([1.0 if p.greedy else p.temperature for p in params], torch.float)
            b.top_k, b.top_p = t([p.top_k for p in params], torch.long), t([p.top_p for p in params], torch.float)
            b.truncate = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
            if any(p.min_p > 0 for p in params):
                b.min_p = t([p.min_p for p in params], torch.float)
            b.greedy = t([p.greedy for p in params], torch.bool)
            b.uniform = torch.rand(len(rows), device=device)
            b.noise = torch.empty(len(rows), vocab_size, device=device).exponential_()
            for start, q, g in seeded:  # seeded requests draw on the CPU: reproducible on any device
                if g is not None:
                    b.uniform[start:start + q] = torch.rand(q, generator=g).to(device)
                    b.noise[start:start + q] = torch.empty(q, vocab_size).exponential_(generator=g).to(device)
        return b


def verify(logits: torch.Tensor, b: SpecBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling over the verify rows' logits [R, V] ->
    (the target's token at each row given the drafts accepted before it [R], accepted drafts [S]).
    A request's new tokens are its first accepted + 1 rows' tokens."""
    from matrixinfer.worker.sampler import filter_logits

    target = argmax_rows(logits.float())
    if b.greedy_only:
        accept = target == b.row_draft
        token = target
    else:
        logits = filter_logits(logits.float(), b.temperature, b.top_k, b.top_p, b.min_p, truncate=b.truncate)
        probs = torch.where(b.greedy[:, None], torch.nn.functional.one_hot(target, logits.shape[-1]).float(),
                            logits.softmax(-1))
        has_draft = b.row_draft >= 0
        d = b.row_draft.clamp(min=0)[:, None]
        accept = has_draft & (b.uniform < probs.gather(1, d)[:, 0])
        residual = torch.where(has_draft[:, None], probs.scatter(1, d, 0.0), probs)  # p - q, q one-hot
        token = argmax_rows(residual / b.noise)  # exponential race: a draw from the normalised residual
    accepted = accept[b.req_rows].long().cumprod(1).sum(1)
    return torch.where(b.row_pos < accepted[b.row_req], b.row_draft, token), accepted


def add_decode_queries(ctx: ForwardContext, reqs: list[ScheduledRequest], device: torch.device) -> None:
    """Give ctx the padded multi-query layout of its decode rows when some carry drafts."""
    dec = reqs[: ctx.num_decode_seqs]
    q = max((len(r.token_ids) for r in dec), default=1)
    if q == 1:
        return
    pad, unpad, lens, off = [], [], [], 0
    for s, r in enumerate(dec):
        n = len(r.token_ids)
        for j in range(q):
            jj = min(j, n - 1)
            pad.append(off + jj)
            lens.append(r.start_pos + jj + 1)
        unpad += range(s * q, s * q + n)
        off += n
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    ctx.decode_query_len, ctx.decode_lens = q, t(lens).view(len(dec), q)
    if len(unpad) < len(pad):  # rows of different lengths: pad them
        ctx.decode_pad_index, ctx.decode_unpad_index = t(pad), t(unpad)


def draft_context(ctx: ForwardContext, b: SpecBatch, positions: torch.Tensor, reqs: list[ScheduledRequest],
                  depth: int, block_size: int, token_rows: bool = False) -> ForwardContext:
    """Context for drafting step `depth` >= 1 of the speculating requests: one query each, at
    the position `depth` past its last accepted row (positions: those rows' positions). The
    exact lengths live on the device; the host's lengths are upper bounds (the gather size).
    token_rows: ctx has a block-table row per token (batch-invariant mode), not per request."""
    tables = ctx.block_tables[b.first_token if token_rows else b.req_index]
    p = positions + depth
    slots = tables.gather(1, (p // block_size)[:, None])[:, 0] * block_size + p % block_size
    bound = [reqs[i].start_pos + len(reqs[i].token_ids) + depth for i in b.host_req_index]
    return ForwardContext(query_lens=[1] * len(bound), context_lens=bound, slot_mapping=slots, block_tables=tables,
                          num_decode_seqs=len(bound), context_lens_tensor=p + 1)
