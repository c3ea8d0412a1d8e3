"""Helpers for engine tests that run ranks as processes: fixed random prompts, greedy token
lists, the live child processes (to check that none outlives its engine), and the dead-rank
check every multi-process layout must pass."""

import multiprocessing as mp
import os
import signal

import pytest

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



def assert_a_dead_rank_fails_and_leaves_no_process(llm_factory, prompt_lengths, params=GREEDY) -> None:
    """SIGKILL rank 1 of the engine llm_factory() builds: the next generate raises (never
    hangs) and, after shutdown, no process the engine started is left."""
    before = children()
    llm = llm_factory()
    try:
        rank1 = llm.engine.core.core.executor.procs[1]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises((RuntimeError, TimeoutError)):
            tokens(llm, prompts(1000, prompt_lengths), params)
    finally:
        llm.shutdown()
    assert not (children() - before)
