"""Requests in: tokenize and validate once, fan `n` samples out into engine requests."""

from __future__ import annotations

import time
from dataclasses import replace

from matrixinfer.engine.messages import EngineCoreRequest
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.tokenizer import Tokenizer


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def parent_id(engine_request_id: str) -> str:
    """The request an engine request (one of its n samples) belongs to."""
    return engine_request_id.split("#")[0]


class Processor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        eos = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             f"tokens and at least one must be left for the output")
        if params.stop_list and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model directory has none")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad[:3]}")

    def engine_requests(self, request_id: str, ids: list[int], params: SamplingParams, namespace: str = "",
                        arrival_time: float | None = None) -> list[EngineCoreRequest]:
        """One engine request per sample; sample i of a seeded request is seeded seed + i."""
        self.validate(ids, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        out = []
        for i in range(params.n):
            p = params if params.n == 1 else replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            out.append(EngineCoreRequest(child_id(request_id, i, params.n), ids, p, namespace, now, self.eos_token_ids))
        return out
