"""The multi-process executor: every rank is an OS process with its own worker, in one
torch.distributed group (gloo on CPU, NCCL on CUDA). Each step the engine core sends the
scheduler's output, pickled once, down a pipe to every rank; the ranks run the step together
(their collectives meet inside the model) and rank 0 sends back the sampled tokens.

Processes never outlive the executor: shutdown() (also run by a finalizer and at interpreter
exit) asks them to stop, then kills what is left; a rank whose parent dies sees its pipe
close and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
import traceback
import weakref
from multiprocessing.connection import wait

from matrixinfer.config import EngineConfig
from matrixinfer.engine.scheduler import ModelRunnerOutput, SchedulerOutput


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
        worker = Worker(config, rank, world_size, init_method)
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
            infos = [self._recv(rank, self.timeout) for rank in range(world)]
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]

    def _recv(self, rank: int, timeout: float | None):
        conn, proc = self.conns[rank], self.procs[rank]
        ready = wait([conn, proc.sentinel], timeout)
        if conn in ready:
            kind, payload = conn.recv()
            if kind == "error":
                raise RuntimeError(f"worker failed:\n{payload}")
            return payload
        if not ready:
            raise TimeoutError(f"rank {rank} did not answer within {timeout} s")
        raise RuntimeError(f"rank {rank} exited with code {proc.exitcode}")

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
