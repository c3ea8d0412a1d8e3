"""The async client the HTTP server talks to (serving's `EngineClient`): the engine core runs
in a process of its own (or, for tests and small setups, in a thread of this one), so the
event loop never waits on a model step.

generate(request) is an async stream of the request's cumulative RequestOutputs; a stream
closed early (client gone, cancelled) aborts the request in the core, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from matrixinfer.config import EngineConfig, ModelConfig
from matrixinfer.engine.core_client import EngineDeadError, InprocCoreClient, MPCoreClient
from matrixinfer.engine.messages import EngineCoreOutputs
from matrixinfer.frontend.output_processor import OutputProcessor
from matrixinfer.frontend.outputs import EngineStats
from matrixinfer.frontend.processor import Processor, parent_id
from matrixinfer.tokenizer import Tokenizer


class _ThreadCore:
    """An in-process core stepped by a thread, with MPCoreClient's surface (outputs queue)."""

    def __init__(self, config: EngineConfig):
        self.inner = InprocCoreClient(config)
        self.max_model_len, self.vocab_size = self.inner.max_model_len, self.inner.vocab_size
        self.outputs: queue.Queue = queue.Queue()
        self._commands: queue.Queue = queue.Queue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def add_request(self, request) -> None:
        self._commands.put(("add", request))

    def abort_requests(self, ids) -> None:
        self._commands.put(("abort", list(ids)))

    def _run(self) -> None:
        while not self._stop:
            block = not self.inner.has_unfinished_requests()
            try:
                while True:
                    kind, payload = self._commands.get(block=block, timeout=0.5 if block else None)
                    block = False
                    if kind == "add":
                        try:
                            self.inner.add_request(payload)
                        except ValueError as e:
                            self.outputs.put(("rejected", (payload.request_id, str(e))))
                    elif kind == "abort":
                        self.inner.abort_requests(payload)
                    else:
                        return
            except queue.Empty:
                pass
            try:
                self.outputs.put(self.inner.get_outputs())
            except Exception as e:  # a broken step fails the requests in flight, not the server
                self.outputs.put(e)
                self.inner.abort_requests(list(self.inner.core.scheduler.requests))

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(("stop", None))
        self._thread.join(10)
        self.inner.shutdown()


class AsyncLLM:
    def __init__(self, config: EngineConfig, model_name: str | None = None, engine_core_process: bool = True):
        self.core = MPCoreClient(config) if engine_core_process else _ThreadCore(config)
        self._init_frontend(config, model_name, self.core.max_model_len, self.core.vocab_size)
        self._dispatcher = threading.Thread(target=self._dispatch, args=(self.core,), name="engine-outputs",
                                            daemon=True)
        self._dispatcher.start()

    def _init_frontend(self, config: EngineConfig, model_name: str | None, max_model_len: int, vocab_size: int) -> None:
        """The text side, shared by every EngineClient built on engine cores (also pdc/)."""
        self.config = config
        self.model_name = model_name or Path(config.model).name
        self.tokenizer = Tokenizer.maybe_load(config.model)
        model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.processor = Processor(self.tokenizer, self.vocab_size, self.max_model_len, model_config.eos_token_id)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.RLock()  # output processor state: touched by callers and dispatchers
        from matrixinfer.engine.messages import SchedulerStats

        self._stats = SchedulerStats()
        self._dead: BaseException | None = None  # set when no engine core is left

    # -- where engine requests go (pdc/ routes them over instances) -----------------------------------
    def _submit(self, reqs) -> None:
        for r in reqs:
            self.core.add_request(r)

    def _abort_children(self, child_ids: list[str]) -> None:
        if child_ids:
            self.core.abort_requests(child_ids)

    @classmethod
    def from_model(cls, model: str | Path, model_name: str | None = None, engine_core_process: bool = True,
                   **engine_args) -> "AsyncLLM":
        return cls(EngineConfig.from_kwargs(str(model), **engine_args), model_name, engine_core_process)

    # -- EngineClient -------------------------------------------------------------------------------
    async def generate(self, request) -> AsyncIterator:
        """request: serving's GenerateRequest (request_id, prompt_token_ids, params, namespace,
        arrival_time). Raises ValueError before the first output when the request is refused."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        if self._dead is not None:
            raise RuntimeError(f"the engine is not running: {self._dead}")
        with self._lock:
            if rid in self.output_processor.requests:
                raise ValueError(f"request id {rid!r} is already in use")
            reqs = self.processor.engine_requests(rid, list(request.prompt_token_ids), request.params,
                                                  request.namespace, request.arrival_time)
            self.output_processor.add_request(rid, None, list(request.prompt_token_ids), request.params,
                                              reqs[0].arrival_time)
            self._streams[rid] = (loop, q)
        finished = False
        try:
            self._submit(reqs)
        except (OSError, RuntimeError) as e:  # the core's pipe is closed, or no instance can take it
            await self.abort(rid)
            raise RuntimeError(f"the engine is not running: {e}") from None
        try:
            while True:
                item = await q.get()
                # outputs are cumulative: a consumer that fell behind takes only the newest
                # (vLLM's output collector merges them likewise), one stream event for several steps
                while not q.empty() and not isinstance(item, BaseException) and not item.finished:
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            ids = self.output_processor.child_ids(request_id)
            self.output_processor.remove(request_id)
            self._streams.pop(request_id, None)
        self._abort_children(ids)

    def stats(self) -> EngineStats:
        s = self.scheduler_stats()
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
                           prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                           spec_num_drafts=s.spec_num_drafts, spec_num_draft_tokens=s.spec_num_draft_tokens,
                           spec_num_accepted_tokens=s.spec_num_accepted_tokens,
                           spec_accepted_per_pos=tuple(s.spec_accepted_per_pos))

    def scheduler_stats(self):
        """The engine core's last SchedulerStats."""
        return self._stats

    def shutdown(self) -> None:
        self.core.shutdown()
        self._fail_all(RuntimeError("the engine is shutting down"))

    # -- outputs from the core ------------------------------------------------------------------------
    def _dispatch(self, core) -> None:
        while True:
            item = core.outputs.get()
            if isinstance(item, BaseException):
                self._fail_all(item)
                if isinstance(item, EngineDeadError):
                    self._dead = item
                    return
                continue
            if isinstance(item, tuple):  # ("rejected", (engine request id, message))
                self._fail_request(parent_id(item[1][0]), ValueError(item[1][1]))
                continue
            self._on_outputs(item)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """End one request's stream with `error` (its other samples are aborted)."""
        with self._lock:
            ids = self.output_processor.child_ids(request_id)
            self.output_processor.remove(request_id)
            target = self._streams.pop(request_id, None)
        self._abort_children(ids)
        if target:
            _call_soon(target[0], target[1].put_nowait, error)

    def _on_outputs(self, out: EngineCoreOutputs) -> None:
        if out.stats is not None:
            self._stats = out.stats
        with self._lock:
            results, to_abort = self.output_processor.process(out.outputs)
            targets = [(r, self._streams.pop(r.request_id, None) if r.finished else self._streams.get(r.request_id))
                       for r in results]
        self._abort_children(to_abort)
        for r, target in targets:
            if target is not None:
                _call_soon(target[0], target[1].put_nowait, r)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            for rid in streams:
                self.output_processor.remove(rid)
        for loop, q in streams.values():
            _call_soon(loop, q.put_nowait, error)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass
