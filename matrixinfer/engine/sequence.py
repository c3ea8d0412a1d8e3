"""One sequence's state through the engine: tokens, cache blocks, progress, outputs."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from matrixinfer.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob


_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 namespace: str = "", arrival_time: float = 0.0):
        self.seq_id = next(_ids)
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.namespace = namespace  # prefix-cache salt: sequences of different namespaces never share blocks
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_preemptions = 0
        self.logprobs: list[Logprob] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed_tokens
