"""Sampling parameters, named and defaulted as in vLLM so users' scripts port over."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What a request reports each step (vLLM's names): CUMULATIVE, everything so far after
    every step that changed it (streams); FINAL_ONLY, one output when it finishes (offline
    generate: a step then builds no output for the other requests, whose token lists it would
    copy each time, O(n^2) over a long answer)."""
    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names), exactly one of: a JSON schema (as text), any
    JSON object, a regex, one of some strings, an EBNF grammar. The sampler masks every token
    that would leave the grammar (worker/structured_output.py, xgrammar)."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # one of several (literal prefix, JSON schema) pairs: a call of one of several tools
    alternatives: tuple[tuple[str, str], ...] | None = None
    suffix: str = ""  # literal text that must follow the structure (a tool call's end marker)
    # tokens of the output that this engine gets as part of its prompt (a decode instance
    # continuing what prefill sampled): the grammar has already read them
    accepted: tuple[int, ...] = ()

    def __post_init__(self):
        given = sum(x is not None for x in (self.json, self.regex, self.choice, self.grammar, self.alternatives))
        if given + self.json_object != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    prompt_logprobs: int | None = None  # top-N besides each prompt token's own logprob (computes the whole prompt)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a grammar
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        errors = []
        if self.n < 1:
            errors.append(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            errors.append(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            errors.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            errors.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            errors.append(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            errors.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            errors.append("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            errors.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.max_tokens is not None and self.max_tokens < 1:
            errors.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            errors.append(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            errors.append(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop_list):
            errors.append("stop strings must be non-empty")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def logits_alone(self, num_output_tokens: int) -> bool:
        """Sampling the next token (after num_output_tokens) depends on nothing but the raw
        logits: no logprobs, penalties, logit bias or grammar, and min_tokens reached (nothing
        masked)."""
        return (self.logprobs is None and not self.has_penalties and not self.logit_bias
                and num_output_tokens >= self.min_tokens and self.structured_outputs is None)

    def takes_argmax(self, num_output_tokens: int) -> bool:
        """The sampler gives this request the argmax of its raw logits: greedy, with nothing
        masked, biased or penalised and no logprobs to return (what a compiled decode graph's
        own greedy pick, and a multi-step decode, stand in for)."""
        return self.greedy and self.logits_alone(num_output_tokens)
