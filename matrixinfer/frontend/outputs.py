"""Request outputs, shaped like vLLM's (RequestOutput.outputs[i].text / .token_ids)."""

from __future__ import annotations

from dataclasses import dataclass, field

from matrixinfer.engine.request import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # with SamplingParams(prompt_logprobs=N): None for the first prompt token, then per position
    # a dict token id -> Logprob holding the actual prompt token and the N most likely (as vLLM)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine for metrics (EngineClient.stats)."""
    num_running: int = 0  # sequences being computed
    num_waiting: int = 0  # sequences queued
    kv_cache_usage: float = 0.0  # fraction of KV cache blocks in use, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    # speculative decoding (MTP): verification steps with drafts, drafts, accepted drafts, per position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
