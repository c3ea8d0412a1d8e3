"""Helpers for engine tests that run ranks as processes: fixed random prompts, greedy token
lists, and the live child processes (to check that none outlives its engine)."""

import multiprocessing as mp

import torch

from matrixinfer import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(vocab: int, lengths=(5, 17, 9, 30)):
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()} for n in lengths]


def tokens(llm, prompt_list, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)]


def children() -> set[int]:
    return {p.pid for p in mp.active_children()}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout: float = 120) -> dict:
    """Spawn `world` processes running target(rank, world, port, *args, results) and collect
    each rank's result from the queue (a string is a traceback: the test fails with it)."""
    import queue

    import pytest
    import torch.multiprocessing as tmp

    port = free_port()
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        out = {}
        for _ in range(world):
            try:
                rank, value = results.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"the ranks gave no result within {timeout} s")
            if isinstance(value, str):
                pytest.fail(f"rank {rank} failed:\n{value}")
            out[rank] = value
        return out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
