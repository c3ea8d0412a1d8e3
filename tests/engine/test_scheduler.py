"""The scheduler's prompts-alone steps (Scheduler.prompts_alone, on where prefill is compiled):
a new prompt with nothing cached steps without the running decodes, which continue at the next
schedule; a prompt with a cached prefix, or one that would leave a decode no free block, joins
them in a mixed step as it does with the option off."""

from matrixinfer.config import SchedulerConfig
from matrixinfer.engine.kv_cache_manager import KVCacheManager
from matrixinfer.engine.request import Request
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.scheduler import ModelRunnerOutput, Scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=50)


def _run(sched: Scheduler, tokens: int = 7):
    """One schedule, each sampling request given `tokens` as its next token."""
    step = sched.schedule()
    ids = [r.request_id for r in step.requests if r.sample]
    sched.update_from_output(step, ModelRunnerOutput(ids, [tokens] * len(ids)))
    return step


def _ids(step) -> list[str]:
    return [r.request_id for r in step.requests]


def test_a_new_prompt_steps_alone_then_the_decodes_and_it_continue_together():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, num_steps=4, prompts_alone=True)
    sched.add_request(Request("d", [1, 2, 3], GREEDY))
    _run(sched)  # d's prompt, alone: nothing else runs
    d = sched.requests["d"]
    table = list(d.block_table)
    sched.add_request(Request("p", [9, 8, 7, 6, 5, 4], GREEDY))
    step = _run(sched)
    assert (_ids(step), step.num_decode, step.num_steps) == (["p"], 0, 1)
    assert step.requests[0].start_pos == 0 and len(step.requests[0].token_ids) == 6
    assert d.output_token_ids == [7] and d.block_table == table  # d neither ran nor took blocks
    step = _run(sched)
    assert (_ids(step), step.num_decode, step.num_steps) == (["d", "p"], 2, 4)  # nothing waits: multi-step

    # the option off: the prompt joins the decodes in one mixed step
    sched = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=32, block_size=4), max_model_len=64,
                      num_steps=4)
    sched.add_request(Request("d", [1, 2, 3], GREEDY))
    _run(sched)
    sched.add_request(Request("p", [9, 8, 7, 6, 5, 4], GREEDY))
    step = _run(sched)
    assert (_ids(step), step.num_decode, step.num_steps) == (["d", "p"], 1, 1)


def test_a_cached_prefix_or_a_full_cache_sends_the_prompt_to_a_mixed_step():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, prompts_alone=True)
    sched.add_request(Request("d", [1, 2, 3, 4, 5, 6], GREEDY))
    _run(sched)
    # its first block (1, 2, 3, 4) is cached: the new prompt starts at position 4, not alone
    sched.add_request(Request("hit", [1, 2, 3, 4, 9, 9], GREEDY))
    step = _run(sched)
    assert (_ids(step), step.num_decode) == (["d", "hit"], 1)
    assert step.requests[1].start_pos == 4

    # 5 blocks: d's prompt fills 2 (positions 0 ... 7); a 9-token prompt needs 3, which would
    # leave d no block for position 8: not alone. The decode step takes its block first, and
    # the prompt no longer fits (2 left): it waits
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, prompts_alone=True)
    sched.add_request(Request("d", [1] * 8, GREEDY))
    _run(sched)
    sched.add_request(Request("big", [2] * 9, GREEDY))
    step = _run(sched)
    assert _ids(step) == ["d"] and len(sched.waiting) == 1 and kv.num_free_blocks == 2
    sched.add_request(Request("small", [3] * 3, GREEDY))
    step = _run(sched)
    assert _ids(step) == ["d"]  # big waits at the head of the queue; nothing jumps it
