"""Turn the last-position logits of each sequence into its next token (and logprobs)."""

from __future__ import annotations

import torch

from matrixinfer.engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row of logits -> temperature-scaled logits with the excluded tokens at -inf."""
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest set whose mass reaches top_p
        drop[0] = False  # and always the most likely token (top_p can round to 0 in float32)
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """logits [S, V] -> (token ids [S], logprob rows [S, V] or None). Greedy rows take argmax."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = filter_logits(logits[i], p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
        if generators[i] is not None:  # per-request generators live on the CPU (reproducible anywhere)
            probs = probs.cpu()
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    return tokens.tolist(), logprobs
