"""The engine core's view of one request: token ids, progress, cache blocks, finish state.
One request is one sequence: the front end fans `n` samples out into n requests."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from matrixinfer.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # its KV is being loaded from elsewhere
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob
    rank: int | None = None  # 1 + how many tokens the model found likelier (prompt logprobs)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens 1..k (token 0 has none), compact: what crosses processes.
    Entry i is for prompt position i + 1, computed from the logits at position i."""
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)  # the N most likely, per position
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def put(self, first: int, chunk: PromptLogprobs) -> None:
        """Place a chunk whose first entry is entry `first` (a recomputed chunk replaces what it covers)."""
        for mine, theirs in zip((self.logprobs, self.ranks, self.top_ids, self.top_logprobs),
                                (chunk.logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs)):
            del mine[first:]
            mine += theirs

    def as_vllm(self, prompt_token_ids: list[int]) -> list[dict[int, Logprob] | None]:
        """vLLM's RequestOutput.prompt_logprobs: None for the first token, then per position a
        dict token id -> Logprob holding the actual prompt token and the top N."""
        out: list[dict[int, Logprob] | None] = [None]
        for i, tok in enumerate(prompt_token_ids[1:len(self) + 1]):
            entry = {tok: Logprob(tok, self.logprobs[i], rank=self.ranks[i])}
            for r, (t, v) in enumerate(zip(self.top_ids[i], self.top_logprobs[i])):
                entry.setdefault(t, Logprob(t, v, rank=r + 1))
            out.append(entry)
        return out


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 namespace: str = "", arrival_time: float = 0.0, eos_token_ids: tuple[int, ...] = ()):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.namespace = namespace  # prefix-cache salt: requests of different namespaces never share blocks
        self.arrival_time = arrival_time
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # names of its full blocks, computed once each
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in a cache (local or external); -1: not looked up
        self.num_external_tokens = 0  # of those, tokens whose KV a connector loads this step
        self.kv_load_failed = False  # a connector failed to load: recompute, never ask it again
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.spec_token_ids: list[int] = []  # drafts for the tokens after the last one (speculative decoding)
        # logprobs of the prompt, when asked; None again once sent with the first output token
        self.prompt_logprobs = PromptLogprobs() if params.prompt_logprobs is not None else None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step wants one
        token of a long sequence)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished
