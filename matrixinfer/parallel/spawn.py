"""Run a function on `world` spawned ranks in a gloo process group and collect what each
returns (tests and benches that need real process groups without an engine)."""

from __future__ import annotations

import os
import queue
import socket
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(target, rank: int, world: int, port: int, sizes: tuple[int, int, int], timeout: float, args: tuple,
                results) -> None:
    import torch
    import torch.distributed as dist

    from matrixinfer.parallel.ep_comm import set_dispatcher
    from matrixinfer.parallel.state import destroy_model_parallel, init_model_parallel

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        init_model_parallel(*sizes)
        results.put((rank, target(rank, world, *args)))
    except BaseException:
        results.put((rank, RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}")))
    finally:
        set_dispatcher(None)
        destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target, world: int, *args, tp: int | None = None, ep: int = 1, sp: int = 1,
              timeout: float = 120) -> dict:
    """Spawn `world` = tp * ep processes, each in one gloo group with init_model_parallel(tp,
    ep) done (tp defaults to world / ep; sp > 1: the SP-TP-SP group of all `world` = sp ranks
    instead), running target(rank, world, *args) (a module-level
    function: it is pickled); return {rank: its return value}. Values cross by pickling: send
    numpy arrays, not tensors (those would be shared through file descriptors that vanish with
    the process). A rank that raises, or no answer within `timeout` seconds, raises here; the
    processes never outlive the call."""
    import torch.multiprocessing as mp

    sizes = (1, 1, sp) if sp > 1 else (tp or world // ep, ep, 1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, port, sizes, timeout, args, results),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        out = {}
        for _ in range(world):
            try:
                rank, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"the ranks gave no result within {timeout} s") from None
            if isinstance(value, RuntimeError):
                raise value
            out[rank] = value
        return out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
