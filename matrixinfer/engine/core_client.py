"""How a front end talks to an engine core: in the same process (offline `LLM`), or with the
core in a process of its own behind a pipe, so that a server's event loop never waits on a
model step (vLLM v1's EngineCoreProc).

Both clients have the same surface: add_request, abort_requests, get_outputs, shutdown.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
import weakref
from multiprocessing.connection import wait

from matrixinfer.config import EngineConfig
from matrixinfer.engine.core import EngineCore
from matrixinfer.engine.messages import EngineCoreOutputs, EngineCoreRequest


class EngineDeadError(RuntimeError):
    """The engine core process is gone: every request in flight fails."""


class InprocCoreClient:
    """The core in the caller's process; get_outputs() runs one step."""

    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.max_model_len, self.vocab_size = self.core.max_model_len, self.core.vocab_size
        self._aborted: list = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids) -> None:
        self._aborted += self.core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_outputs(self) -> EngineCoreOutputs:
        out = self.core.step()
        out.outputs = self._aborted + out.outputs
        self._aborted = []
        return out

    def shutdown(self) -> None:
        self.core.shutdown()


def _core_main(config: EngineConfig, conn, title: str, parent_pid: int | None = None) -> None:
    """The engine core process: apply requests and aborts, step while there is work, send
    every step's outputs back. parent_pid: the front end's process, watched while the core
    starts (a start-up compile does not read the pipe, so its closing goes unseen)."""
    from matrixinfer.lifetime import exit_with_parent, ignore_group_signals

    ignore_group_signals()  # the front end drains, then stops us; its death closes our pipe
    # before torch starts its threads and the executor its ranks: they inherit it
    os.nice(config.engine_core_nice)
    started = exit_with_parent(parent_pid) if parent_pid is not None else None
    try:
        import setproctitle

        setproctitle.setproctitle(title)  # `ps` / `top` show which role this process is
    except ImportError:
        pass
    try:
        core = EngineCore(config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    info = core.executor.info
    core.executor.set_interrupt(conn.poll)  # a message (a request to join, an abort) ends a multi-step run
    conn.send(("ready", (core.max_model_len, core.vocab_size, info.kv_bytes_per_block / config.cache.block_size,
                         info.weights, os.getpid())))
    if started is not None:
        started.set()  # from here on the pipe tells us: a closed one ends the loop, which shuts down in order
    try:
        while True:
            if not core.has_unfinished_requests():
                wait([conn])  # idle: block until a message arrives
            aborted = []
            while conn.poll():
                msg = conn.recv()
                if msg is None:
                    return
                kind, payload = msg
                if kind == "add":
                    try:
                        core.add_request(payload)
                    except ValueError as e:
                        conn.send(("rejected", (payload.request_id, str(e))))
                else:
                    aborted += core.abort_requests(payload)
            out = core.step()
            out.outputs = aborted + out.outputs
            conn.send(("outputs", out))
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the front end went away
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        core.shutdown()


def _stop_core(proc, conn) -> None:
    try:
        conn.send(None)
    except OSError:
        pass
    proc.join(15)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    conn.close()


class RemoteCoreClient:
    """An engine core elsewhere (another process here, or a Ray actor on another machine)
    behind a multiprocessing Connection. A reader thread puts what the core sends on `outputs`
    (EngineCoreOutputs, ("rejected", (request id, message))) or an EngineDeadError when the
    connection closes. Subclasses start the core and call _handshake."""

    pid: int | None = None

    def _handshake(self, conn, waitables: list, timeout: float, started: float) -> None:
        self.conn = conn
        ready = wait([conn, *waitables], timeout)
        if conn not in ready:
            self.shutdown()
            raise RuntimeError("the engine core did not start" + ("" if ready else " in time"))
        kind, payload = conn.recv()
        if kind == "error":
            self.shutdown()
            raise RuntimeError(f"the engine core failed to start:\n{payload}")
        self.max_model_len, self.vocab_size, self.kv_bytes_per_token, self.weights_report, self.pid = payload
        self.start_seconds = time.monotonic() - started
        self._send_lock = threading.Lock()
        self.outputs: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                self.outputs.put(EngineDeadError("the engine core process exited"))
                return
            if kind == "error":
                self.outputs.put(EngineDeadError(f"the engine core failed:\n{payload}"))
                return
            self.outputs.put(payload if kind == "outputs" else (kind, payload))

    def _send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(("add", request))

    def abort_requests(self, request_ids) -> None:
        self._send(("abort", list(request_ids)))

    def shutdown(self) -> None:
        self._finalizer()


class MPCoreClient(RemoteCoreClient):
    """The core in a process of its own on this machine, behind a pipe."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0, title: str = "matrixinfer::engine-core"):
        started = time.monotonic()
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        # Not daemonic: the core must be able to start its own rank processes (TP / EP / SP
        # executors). It still cannot outlive us: the finalizer stops it, at interpreter exit too
        # (registered after multiprocessing's own exit hook, so it runs first: that hook joins
        # non-daemonic children), and a core whose front end is gone sees its pipe close.
        self.proc = ctx.Process(target=_core_main, args=(config, child, title, os.getpid()), name=title, daemon=False)
        self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop_core, self.proc, conn)
        atexit.register(self._finalizer)
        self._handshake(conn, [self.proc.sentinel], start_timeout_s, started)

    def shutdown(self) -> None:
        super().shutdown()
        atexit.unregister(self._finalizer)  # restarted instances would otherwise pile them up

    def kill(self) -> None:
        """SIGKILL the core (failure tests)."""
        self.proc.kill()
        self.proc.join(10)
