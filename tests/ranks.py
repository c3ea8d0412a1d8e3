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

