"""The async engine interface the HTTP API talks to, and its one-instance implementation.

The API layer knows only `EngineClient`: `generate(request)` is an async stream of the
request's cumulative outputs, `abort(request_id)` stops it and frees its cache blocks, and
`stats()` is a snapshot for metrics. Where the tokens are computed is not its business:
`AsyncLLMEngine` runs one LLMEngine's step loop in a background thread; a PDC front end
(prefill and decode pools) implements the same interface.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from matrixinfer.engine.outputs import RequestOutput
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.tokenizer import Tokenizer


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str = ""  # prefix-cache namespace: the tenant, so tenants never share cached blocks
    arrival_time: float | None = None  # time.monotonic() when the request arrived


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0  # sequences being computed
    num_waiting: int = 0  # sequences queued
    kv_cache_usage: float = 0.0  # fraction of KV cache blocks in use, 0..1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found


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


class AsyncLLMEngine:
    """One LLMEngine driven by a background thread. The thread owns the engine: requests and
    aborts reach it through a command queue, outputs go back to each request's asyncio queue
    on the event loop that asked."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.config.vocab_size
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = EngineStats()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @classmethod
    def from_model(cls, model: str | Path, model_name: str | None = None, dtype: str = "auto",
                   device: str = "cpu", block_size: int = 16, num_blocks: int | None = None,
                   max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                   max_model_len: int | None = None, kv_cache_memory_gb: float = 1.0,
                   enable_prefix_caching: bool = True, seed: int = 0) -> "AsyncLLMEngine":
        from matrixinfer.config import CacheConfig, SchedulerConfig
        from matrixinfer.engine.llm_engine import LLMEngine

        engine = LLMEngine(
            model, dtype=dtype, device=device,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            kv_cache_memory_gb=kv_cache_memory_gb, seed=seed,
        )
        return cls(engine, model_name or Path(model).name)

    # -- EngineClient ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        finished = False
        self._submit(("add", request, loop, queue, added))
        try:
            await added  # ValueError from the engine's own checks comes out here
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled, closed early or the client went away
                self._submit(("abort", request.request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    # -- lifetime -------------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    # -- the engine thread ----------------------------------------------------------------------
    def _submit(self, command: tuple) -> None:
        self.start()
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._apply_commands()
            if not engine.has_unfinished_requests():
                self._publish_stats()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():  # the sampler edits the runner's (inference) logits in place
                    outputs = engine.step()
            except Exception as e:  # a broken step fails every request in flight, not the server
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, last=out.finished)
            self._publish_stats()
        self._fail_all(RuntimeError("the engine is shutting down"))

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                self._streams.pop(command[1], None)
                self.engine.abort_request(command[1])
                continue
            _, req, loop, queue, added = command
            try:
                self.engine.add_request(req.request_id, {"prompt_token_ids": req.prompt_token_ids}, req.params,
                                        namespace=req.namespace, arrival_time=req.arrival_time)
            except ValueError as e:
                _call_soon(loop, _set_future, added, e)
                continue
            self._streams[req.request_id] = (loop, queue)
            _call_soon(loop, _set_future, added, None)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None:
            _call_soon(target[0], target[1].put_nowait, item)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            self._deliver(request_id, error, last=True)
        self._publish_stats()

    def _publish_stats(self) -> None:
        e = self.engine
        self._stats = EngineStats(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            kv_cache_usage=e.block_manager.usage, prefix_cache_queries=e.block_manager.prefix_queries,
            prefix_cache_hits=e.block_manager.prefix_hits,
        )


def _set_future(fut: asyncio.Future, error: Exception | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass
