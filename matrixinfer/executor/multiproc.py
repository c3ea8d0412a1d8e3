"""The multi-process executor: every rank is an OS process with its own worker, in one
torch.distributed group (gloo on CPU, NCCL on CUDA). Each step the engine core sends the
scheduler's output, pickled once, down a pipe to every rank; the ranks run the step together
(their collectives meet inside the model) and rank 0 sends back the sampled tokens.

Start-up has no fixed deadline: each rank reports every stage (loading, each graph its
warm-up compiles) down its pipe, and a rank that says nothing for distributed_timeout_s
(stalled) or exits is named in the error with its last reports. Two ranks compiling on two
cores took longer than any fixed bound that would still catch a hung rank.

Processes never outlive the executor: shutdown() (also run by a finalizer and at interpreter
exit) asks them to stop, then kills what is left; a rank whose parent dies sees its pipe
close and exits.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import socket
import time
import traceback
import weakref
from collections import deque
from multiprocessing.connection import wait

from matrixinfer.config import EngineConfig
from matrixinfer.engine.scheduler import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)
LAST_REPORTS = 5  # a failed start names each rank's last few stages


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str, conn) -> None:
    from matrixinfer.lifetime import ignore_group_signals
    from matrixinfer.worker.worker import Worker, worker_env_threads

    ignore_group_signals()  # the engine stops us; its death closes our pipe
    worker = None
    try:
        worker_env_threads(world_size)
        worker = Worker(config, rank, world_size, init_method, report=lambda text: conn.send(("progress", text)))
        conn.send(("ready", worker.info()))
        while True:
            data = conn.recv_bytes()
            sched = pickle.loads(data)
            if sched is None:
                break
            out = worker.execute_model(sched)
            if rank == 0:
                conn.send(("ok", out))
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the engine went away
    except BaseException:
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:
                pass


def _stop(procs, conns, timeout: float = 10.0) -> None:
    for c in conns:
        try:
            c.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    for c in conns:
        c.close()


def wait_until_ready(conns, procs, timeout: float) -> list:
    """Every rank's info (its "ready" message) once all are ready. A rank is waited for as
    long as it reports progress; silent for `timeout` seconds, or dead, it fails the start,
    named with its last reports."""
    world = len(procs)
    infos: list = [None] * world
    heard = [time.monotonic()] * world
    reports = [deque(maxlen=LAST_REPORTS) for _ in range(world)]

    def last_words(rank: int) -> str:
        return "; its last reports: " + (" | ".join(reports[rank]) or "none (it never got going)")

    pending = set(range(world))
    while pending:
        now = time.monotonic()
        stalled = [r for r in pending if now - heard[r] > timeout]
        if stalled:
            r = stalled[0]
            raise TimeoutError(f"rank {r} stalled: no progress for {timeout:g} s" + last_words(r))
        waiting = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = wait(waiting, max(0.0, min(heard[r] + timeout for r in pending) - now))
        for r in sorted(pending):
            if conns[r] in ready:
                kind, payload = conns[r].recv()
                heard[r] = time.monotonic()
                if kind == "error":
                    raise RuntimeError(f"worker failed:\n{payload}")
                if kind == "progress":
                    reports[r].append(payload)
                    log.info("rank %d: %s", r, payload)
                else:
                    infos[r] = payload
                    pending.discard(r)
            elif procs[r].sentinel in ready:
                raise RuntimeError(f"rank {r} exited with code {procs[r].exitcode} during start-up"
                                   + last_words(r))
    return infos


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        ctx = mp.get_context("spawn")
        world = config.parallel.world_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs, self.conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(config, rank, world, init_method, child),
                            name=f"matrixinfer-rank{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self.timeout = config.parallel.distributed_timeout_s
        try:
            self.info = wait_until_ready(self.conns, self.procs, self.timeout)[0]
        except BaseException:
            self.shutdown()
            raise

    def set_interrupt(self, interrupt) -> None:
        """Multi-step decode runs its k steps here: the ranks, in processes of their own, must
        all run the same steps, and none of them sees the engine core's pipe."""

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        data = pickle.dumps(sched, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, c in enumerate(self.conns):
            try:
                c.send_bytes(data)
            except OSError:
                raise RuntimeError(f"rank {rank} is gone (exit code {self.procs[rank].exitcode})") from None
        # rank 0 answers; any rank may instead report an error or die
        ready = wait(self.conns + [p.sentinel for p in self.procs], self.timeout)
        if not ready:
            raise TimeoutError(f"the ranks did not finish a step within {self.timeout} s")
        for rank, c in enumerate(self.conns):
            if c in ready:
                kind, payload = c.recv()
                if kind == "error":
                    raise RuntimeError(f"worker failed:\n{payload}")
                return payload
        dead = [r for r, p in enumerate(self.procs) if p.sentinel in ready]
        raise RuntimeError(f"rank(s) {dead} exited during a step (exit codes {[self.procs[r].exitcode for r in dead]})")

    def shutdown(self) -> None:
        self._finalizer()
