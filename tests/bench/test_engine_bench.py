"""`matrixinfer bench engine`'s profile of a decode step (engine_bench.profile_decode)."""

import time

from matrixinfer import LLM, SamplingParams
from matrixinfer.bench.engine_bench import UNTRACED, profile_decode


def test_profile_shares_are_of_the_wall_time_and_count_what_no_operator_covers(text_checkpoint):
    """The table's shares are of the profiled wall time (so they add up to at most 100 %, where
    shares of the operators' own sum said 55 % for the allocations of a replayed graph whose
    kernels the profiler cannot see), the time outside every operator is a row of its own, and
    ms per decode step times the steps is no more than the wall time they took."""
    llm = LLM(model=str(text_checkpoint[0]), dtype="float32", enforce_eager=True, max_num_seqs=4)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    t = time.perf_counter()
    rows = profile_decode(llm, prompts, output_len=32, steps=10)
    per_step_ms = (time.perf_counter() - t) * 1e3 / 10  # with the prefill and the profiler around it: an upper bound
    assert rows and all(len(r) == 3 for r in rows)
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)
    assert sum(r[1] for r in rows) <= 100.5
    assert UNTRACED in [r[0] for r in rows]
    assert sum(r[2] for r in rows) <= per_step_ms
    assert not llm.engine.has_unfinished_requests()
