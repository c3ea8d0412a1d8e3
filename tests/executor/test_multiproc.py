"""The multi-process executor: ranks as OS processes in a gloo group stepping together.

Tensor parallelism is the proof: greedy output at TP=2 is token-identical to one process,
and the processes never outlive the engine, even when a rank dies.
"""

import multiprocessing as mp
import os
import signal

import pytest
import torch

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import DEFAULT_MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(vocab: int, lengths=(5, 17, 9, 30)):
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()} for n in lengths]


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _children() -> set[int]:
    return {p.pid for p in mp.active_children()}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bundled", "hf"])
def test_tensor_parallel_2_is_token_identical(model, hf_checkpoint):
    """TP=2 over two gloo processes (chunked prefill, small blocks, mixed batch) gives the
    same greedy tokens as one process, on the bundled model and the oracle configs."""
    if hf_checkpoint[0].name.rstrip("0123456789") != "v3-qlora-yarn":
        pytest.skip("once per model: tests/parallel covers every oracle variant at the model level")
    path = DEFAULT_MODEL if model == "bundled" else hf_checkpoint[0]
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=24)
    single = LLM(model=path, **kw)
    prompts = _prompts(single.engine.model_config.vocab_size)
    expected = _tokens(single, prompts)
    before = _children()
    with LLM(model=path, tensor_parallel_size=2, **kw) as tp:
        assert len(_children() - before) == 2
        assert _tokens(tp, prompts) == expected
        seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
        assert _tokens(tp, prompts, seeded) == _tokens(single, prompts, seeded)
    assert not (_children() - before)  # both ranks are gone


@pytest.mark.slow
def test_multiprocess_executor_at_tp1_equals_in_process():
    kw = dict(dtype="float32", max_num_batched_tokens=64)
    prompts = _prompts(1000)
    expected = _tokens(LLM(**kw), prompts)
    with LLM(distributed_executor_backend="mp", **kw) as llm:
        assert _tokens(llm, prompts) == expected


@pytest.mark.slow
def test_a_dead_rank_is_an_error_not_a_hang_and_leaves_no_process():
    before = _children()
    llm = LLM(tensor_parallel_size=2, dtype="float32")
    try:
        rank1 = llm.engine.core.core.executor.procs[1]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises((RuntimeError, TimeoutError)):
            _tokens(llm, _prompts(1000, (8,)))
    finally:
        llm.shutdown()
    assert not (_children() - before)


@pytest.mark.slow
def test_tensor_parallel_2_with_mtp_speculation_is_token_identical():
    """Every rank verifies, accepts and drafts (the MTP layer is tensor-parallel too): greedy
    output at TP=2 with MTP drafts equals one process without them, and seeded sampling equals
    one process with them (the ranks draw the same random numbers)."""
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=24)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = _prompts(1000)
    expected = _tokens(LLM(**kw), prompts)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    spec_seeded = _tokens(LLM(speculative_config=mtp, **kw), prompts, seeded)
    with LLM(tensor_parallel_size=2, speculative_config=mtp, **kw) as tp:
        assert _tokens(tp, prompts) == expected
        assert _tokens(tp, prompts, seeded) == spec_seeded
        assert tp.engine.stats.spec_num_accepted_tokens > 0
