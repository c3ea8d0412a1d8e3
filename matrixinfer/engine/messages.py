"""What crosses the engine core's boundary: typed messages, token ids only (no text)."""

from __future__ import annotations

from dataclasses import dataclass, field

from matrixinfer.engine.request import Logprob, PromptLogprobs
from matrixinfer.engine.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str = ""
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with a request's first token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found locally
    external_cache_hits: int = 0  # of which loaded by the KV connector
    num_preemptions: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # speculative decoding, as vLLM counts it: verification steps of a request with drafts, drafts
    # verified, drafts accepted, and accepted per draft position (the i-th draft of a step)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted drafts per step (vLLM's)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
