"""The async engine interface the HTTP API talks to, and its one-instance implementation.

The API layer knows only `EngineClient`: `generate(request)` is an async stream of the
request's cumulative outputs, `abort(request_id)` stops it and frees its cache blocks, and
`stats()` is a snapshot for metrics. Where the tokens are computed is not its business:
`AsyncLLMEngine` (matrixinfer.frontend.AsyncLLM) talks to an engine core in a process of its
own; a PDC front end (prefill and decode pools) implements the same interface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.frontend.outputs import EngineStats, RequestOutput
from matrixinfer.tokenizer import Tokenizer


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str = ""  # prefix-cache namespace: the tenant, so tenants never share cached blocks
    arrival_time: float | None = None  # time.monotonic() when the request arrived


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: Tokenizer | None
    vocab_size: int

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of the request, the last one with finished=True. Raises
        ValueError (before the first output) when the engine rejects the request."""

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...


# The implementation: the front end's AsyncLLM (engine core in its own process by default).
from matrixinfer.frontend.async_llm import AsyncLLM as AsyncLLMEngine  # noqa: E402
