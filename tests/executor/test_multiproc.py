"""The multi-process executor: ranks as OS processes in a gloo group stepping together.

Tensor parallelism is the proof: greedy output at TP=2 is token-identical to one process,
and the processes never outlive the engine, even when a rank dies.
"""


import pytest

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import DEFAULT_MODEL
from tests import ranks


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
    prompts = ranks.prompts(single.engine.model_config.vocab_size)
    expected = ranks.tokens(single, prompts)
    before = ranks.children()
    with LLM(model=path, tensor_parallel_size=2, **kw) as tp:
        assert len(ranks.children() - before) == 2
        assert ranks.tokens(tp, prompts) == expected
        seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
        assert ranks.tokens(tp, prompts, seeded) == ranks.tokens(single, prompts, seeded)
    assert not (ranks.children() - before)  # both ranks are gone


@pytest.mark.slow
def test_multiprocess_executor_at_tp1_equals_in_process():
    kw = dict(dtype="float32", max_num_batched_tokens=64)
    prompts = ranks.prompts(1000)
    expected = ranks.tokens(LLM(**kw), prompts)
    with LLM(distributed_executor_backend="mp", **kw) as llm:
        assert ranks.tokens(llm, prompts) == expected


@pytest.mark.slow
def test_a_dead_rank_is_an_error_not_a_hang_and_leaves_no_process():
    ranks.assert_a_dead_rank_fails_and_leaves_no_process(lambda: LLM(tensor_parallel_size=2, dtype="float32"), (8,))


@pytest.mark.slow
def test_tensor_parallel_2_with_mtp_speculation_is_token_identical():
    """Every rank verifies, accepts and drafts (the MTP layer is tensor-parallel too): greedy
    output at TP=2 with MTP drafts equals one process without them, and seeded sampling equals
    one process with them (the ranks draw the same random numbers)."""
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=24)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = ranks.prompts(1000)
    expected = ranks.tokens(LLM(**kw), prompts)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    spec_seeded = ranks.tokens(LLM(speculative_config=mtp, **kw), prompts, seeded)
    with LLM(tensor_parallel_size=2, speculative_config=mtp, **kw) as tp:
        assert ranks.tokens(tp, prompts) == expected
        assert ranks.tokens(tp, prompts, seeded) == spec_seeded
        assert tp.engine.stats.spec_num_accepted_tokens > 0


def _rank_reporting(conn, reports: int, every_s: float) -> None:
    """A stand-in rank start-up: `reports` progress reports `every_s` apart, then ready."""
    import time

    for i in range(reports):
        conn.send(("progress", f"stage {i}"))
        time.sleep(every_s)
    conn.send(("ready", "info"))
    conn.recv()  # until the test closes the pipe


def _rank_stalling(conn) -> None:
    import time

    conn.send(("progress", "decode step, batch 4 of 8: compiling"))
    time.sleep(60)


def _start(targets):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for target, args in targets:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    return conns, procs


@pytest.mark.slow
def test_start_up_waits_while_ranks_report_and_names_a_stalled_rank_with_its_last_report():
    """No fixed start-up deadline: a rank reporting a stage every 1.5 s for 24 s is waited for
    under a 20 s stall bound (two ranks compiling on two cores had outlived the fixed 120 s),
    while a rank silent past the bound fails the start, named with what it last said. (The
    bound leaves a spawned process its imports before its first report: over 10 s on a loaded
    two-core machine.)"""
    from matrixinfer.executor.multiproc import _stop, wait_until_ready

    conns, procs = _start([(_rank_reporting, (16, 1.5)), (_rank_reporting, (1, 0.0))])
    try:
        assert wait_until_ready(conns, procs, timeout=20.0) == ["info", "info"]
    finally:
        _stop(procs, conns, timeout=5)
    conns, procs = _start([(_rank_reporting, (1, 0.0)), (_rank_stalling, ())])
    try:
        with pytest.raises(TimeoutError, match=r"rank 1 stalled: no progress for 20 s; its last reports: "
                                               r"decode step, batch 4 of 8: compiling"):
            wait_until_ready(conns, procs, timeout=20.0)
    finally:
        _stop(procs, conns, timeout=1)
    assert not any(p.is_alive() for p in procs)
