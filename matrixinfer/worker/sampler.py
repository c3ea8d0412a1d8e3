"""Next tokens from last-position logits, for the whole batch at once on the device.

Order as in vLLM: logprobs of the raw model distribution; then logit bias, min_tokens (eos
and stop ids masked), presence / frequency / repetition penalties; greedy rows take the
argmax of the processed logits; the others scale by temperature, filter by min-p, top-k and
top-p, and sample by the exponential race (argmax of p / q with q ~ Exp(1)), which needs no
per-row multinomial and lets a seeded row draw its q from its own generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.kernels import argmax_rows


@dataclass
class SamplingRow:
    """What sampling needs of one sequence."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] long
    logprobs: torch.Tensor | None = None  # [S] logprob of the sampled token (None: no row asked)
    top_ids: torch.Tensor | None = None  # [S, K] K = the largest top-logprobs count asked
    top_logprobs: torch.Tensor | None = None


def filter_logits(logits: torch.Tensor, temperature, top_k, top_p, min_p, truncate: bool | None = None) -> torch.Tensor:
    """Logits [S, V] (or [V]) -> temperature-scaled logits with excluded tokens at -inf. The
    parameters are floats/ints or per-row tensors [S]; top_k <= 0 and top_p >= 1 disable.
    truncate: whether some row filters by top-k / top-p / min-p, when the caller knows (None:
    find out from the tensors, which waits for the device)."""
    squeeze = logits.dim() == 1
    if squeeze:
        logits = logits[None]
    s, v = logits.shape
    col = lambda x, dt: torch.as_tensor(x, dtype=dt, device=logits.device).expand(s)[:, None]  # noqa: E731
    logits = logits / col(temperature, logits.dtype)
    if min_p is not None and (truncate if truncate is not None else bool((torch.as_tensor(min_p) > 0).any())):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < col(min_p, logits.dtype) * probs.amax(-1, keepdim=True), float("-inf"))
    k = col(top_k, torch.long)
    k = torch.where((k <= 0) | (k > v), v, k)
    p = col(top_p, logits.dtype)
    if truncate if truncate is not None else (bool((k < v).any()) or bool((p < 1).any())):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=logits.device)[None]
        drop = rank >= k
        probs = sorted_logits.softmax(-1)
        # keep the smallest set whose mass reaches top_p, and always the most likely token
        drop |= (probs.cumsum(-1) - probs >= p) & (rank > 0)
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits[0] if squeeze else logits


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    dev, v = logits.device, logits.shape[1]
    idx = torch.tensor(which, device=dev)
    sub = logits[idx]
    counts = torch.zeros(len(which), v, device=dev)
    seen = torch.zeros(len(which), v, dtype=torch.bool, device=dev)
    for j, i in enumerate(which):
        out = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=dev)
        counts[j].index_add_(0, out, torch.ones(out.numel(), device=dev))
        seen[j, torch.tensor(rows[i].prompt_token_ids, dtype=torch.long, device=dev)] = True
    seen |= counts > 0
    p = [rows[i].params for i in which]
    rep = torch.tensor([x.repetition_penalty for x in p], device=dev)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= torch.tensor([x.frequency_penalty for x in p], device=dev)[:, None] * counts
    sub -= torch.tensor([x.presence_penalty for x in p], device=dev)[:, None] * (counts > 0)
    logits[idx] = sub.to(logits.dtype)


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Logit bias, min_tokens and penalties, in place on float32 logits [S, V]."""
    bias_r, bias_c, bias_v, mask_r, mask_c, penalized = [], [], [], [], [], []
    for i, r in enumerate(rows):
        p = r.params
        for tok, b in (p.logit_bias or {}).items():
            bias_r.append(i), bias_c.append(tok), bias_v.append(b)
        if len(r.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            mask_r += [i] * len(stops)
            mask_c += list(stops)
        if p.has_penalties:
            penalized.append(i)
    dev = logits.device
    if bias_r:
        logits.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_c, device=dev)),
                          torch.tensor(bias_v, device=dev), accumulate=True)
    if mask_r:
        logits[torch.tensor(mask_r, device=dev), torch.tensor(mask_c, device=dev)] = float("-inf")
    if penalized:
        _apply_penalties(logits, rows, penalized)
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           constrain: Callable[[torch.Tensor], None] | None = None) -> SamplerOutput:
    """`constrain`: sets forbidden tokens' logits to -inf in place (structured outputs' grammar
    masks), after the logits processors; logprobs stay those of the raw distribution."""
    logits = logits.float()
    num_logprobs = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if num_logprobs else None
    logits = process_logits(logits, rows)
    if constrain is not None:
        constrain(logits)
    tokens = argmax_rows(logits)
    random = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random:
        dev = logits.device
        idx = torch.tensor(random, device=dev)
        ps = [rows[i].params for i in random]
        filtered = filter_logits(logits[idx], torch.tensor([p.temperature for p in ps], device=dev),
                                 torch.tensor([p.top_k for p in ps], device=dev),
                                 torch.tensor([p.top_p for p in ps], device=dev),
                                 torch.tensor([p.min_p for p in ps], device=dev))
        q = torch.empty_like(filtered).exponential_()
        for j, i in enumerate(random):
            g = rows[i].generator
            if g is not None:  # seeded rows draw on the CPU: reproducible on any device and batch
                q[j] = torch.empty(q.shape[1]).exponential_(generator=g).to(dev)
        tokens[idx] = argmax_rows(filtered.softmax(-1) / q)
    if raw_logprobs is None:
        return SamplerOutput(tokens)
    k = max(num_logprobs)
    top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
    return SamplerOutput(tokens, raw_logprobs.gather(1, tokens[:, None])[:, 0], top_ids, top_vals)
