"""Multi-step decode (SchedulerConfig.num_scheduler_steps): one schedule covers k greedy decode
steps only where that cannot change a token (every running request decodes by the raw argmax,
none waits, no request runs past its max_tokens or the context), stops inside the k tokens hold,
and the engine's greedy output is token-identical to one step per schedule."""

import pytest
import torch

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import EngineConfig, SchedulerConfig
from matrixinfer.engine.kv_cache_manager import KVCacheManager
from matrixinfer.engine.request import Request, RequestStatus
from matrixinfer.engine.scheduler import ModelRunnerOutput, Scheduler
from tests.hf_fixtures import make_checkpoint


def _decoding(sched: Scheduler, rid: str, params: SamplingParams, prompt=(1, 2, 3)) -> Request:
    """A request added, prefilled and given its first token (7)."""
    req = Request(rid, list(prompt), params)
    sched.add_request(req)
    step = sched.schedule()
    sched.update_from_output(step, ModelRunnerOutput([r.request_id for r in step.requests],
                                                     [7] * len(step.requests)))
    return req


def test_scheduler_covers_k_steps_only_where_no_token_can_change():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, num_steps=4)
    greedy = _decoding(sched, "g", SamplingParams(temperature=0, max_tokens=20))
    step = sched.schedule()
    row = step.requests[0]
    # slots for positions 3 ... 6 (the last token and the three it feeds itself): two blocks
    assert (step.num_steps, row.token_ids, row.start_pos, len(row.block_table)) == (4, [7], 3, 2)
    # the worker's 4 tokens; a stop id among them ends the request there, the rest is dropped
    sched.update_from_output(step, ModelRunnerOutput(["g"], [5], new_token_ids=[[5, 6, 8, 9]]))
    assert greedy.output_token_ids == [7, 5, 6, 8, 9] and greedy.num_computed_tokens == 7
    assert sched.stats.decode_tokens == 4
    assert [kv.blocks[b].token_ids for b in greedy.block_table[:1]] == [[1, 2, 3, 7]]
    # a run that an interrupt ended after 2 of its 4 steps: 2 tokens, their KV counted, 2 steps
    step, steps = sched.schedule(), sched.stats.steps
    assert step.num_steps == 4 and len(step.requests[0].block_table) == 3
    sched.update_from_output(step, ModelRunnerOutput(["g"], [4], new_token_ids=[[4, 4]]))
    assert greedy.output_token_ids[-2:] == [4, 4] and greedy.num_computed_tokens == 9
    assert sched.stats.steps - steps == 2 and sched.stats.decode_tokens == 6

    # one that waits (its prefill would wait behind the k steps): one step, the prefill joins
    sched.add_request(Request("w", [4, 5], SamplingParams(temperature=0, max_tokens=20)))
    assert sched.schedule().num_steps == 1
    sched.finish_requests(["w"], RequestStatus.FINISHED_ABORTED)
    # one decoding beside it that samples, asks for logprobs or has penalties: one step
    for params in (SamplingParams(temperature=0.8, max_tokens=20), SamplingParams(temperature=0, logprobs=1),
                   SamplingParams(temperature=0, repetition_penalty=1.1)):
        _decoding(sched, "o", params, prompt=[4, 5])
        assert sched.schedule().num_steps == 1
        sched.finish_requests(["o"], RequestStatus.FINISHED_ABORTED)
        assert sched.schedule().num_steps == 4
    # no more steps than the request may still take (max_tokens), nor than the context holds
    greedy.params.max_tokens = len(greedy.output_token_ids) + 2
    assert sched.schedule().num_steps == 2
    greedy.params.max_tokens = None
    sched.max_model_len = greedy.num_tokens + 3
    assert sched.schedule().num_steps == 3


def test_stops_inside_the_k_tokens_and_no_lookahead_without_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, num_steps=8)
    req = _decoding(sched, "r", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[6]), prompt=[1] * 8)
    # positions 8 ... 15 need blocks 3 and 4: free; then the request stops at its second token
    step = sched.schedule()
    assert step.num_steps == 8 and len(step.requests[0].block_table) == 4
    out = sched.update_from_output(step, ModelRunnerOutput(["r"], [5], new_token_ids=[[5, 6, 9, 9, 9, 9, 9, 9]]))
    assert out[0].new_token_ids == [5, 6] and out[0].finish_reason == "stop" and req.stop_reason == 6
    assert len(kv.free_queue) == 4  # its blocks are back

    # two requests of 12 tokens hold 3 blocks each of 8 (one free): the lookahead of 8 steps
    # would take another block each, so the schedule covers one step and preempts nobody
    kv = KVCacheManager(num_blocks=7, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, num_steps=8)
    a, b = (_decoding(sched, rid, SamplingParams(temperature=0, max_tokens=30), prompt=[1] * 11) for rid in "ab")
    step = sched.schedule()
    assert step.num_steps == 1 and len(step.requests) == 2 and a.status is b.status is RequestStatus.RUNNING
    assert sched.stats.num_preemptions == 0


def test_num_scheduler_steps_resolves_to_the_compiled_decode_step():
    assert EngineConfig.from_kwargs("m", enforce_eager=False).decode_steps > 1
    assert EngineConfig.from_kwargs("m", enforce_eager=True).decode_steps == 1
    assert EngineConfig.from_kwargs("m", enforce_eager=False, num_scheduler_steps=1).decode_steps == 1
    with pytest.raises(ValueError, match="compiled decode step"):
        EngineConfig.from_kwargs("m", enforce_eager=True, num_scheduler_steps=4)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig.from_kwargs("m", num_scheduler_steps=0)


@pytest.mark.slow
def test_multi_step_greedy_output_is_token_identical(tmp_path):
    """One compiled engine, its scheduler at 1 step per schedule, then 5: the same greedy tokens
    and finish reasons, with stop ids hit inside a multi-step run, max_tokens that are not
    multiples of 5, more prompts than max_num_seqs (arrivals wait, then join at a schedule),
    and a sampling request in the mix (single steps while it runs, its tokens seeded); and with
    runs that an interrupt (the engine core's: a message arrived) ends early. The single-step
    run mixes each joining prompt into the decodes' step; the others step it alone
    (Scheduler.prompts_alone, on with the compiled prefill)."""
    make_checkpoint(tmp_path, "v3-noqlora")
    llm = LLM(model=tmp_path, dtype="float32", block_size=4, max_num_seqs=4, enable_prefix_caching=False,
              enforce_eager=False)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()} for n in (5, 17, 9, 30, 3, 12)]
    free = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (23, 17, 31, 9, 26, 14)]
    scheduler = llm.engine.scheduler
    scheduler.num_steps = 1
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    # stops at tokens the free run produced, at places inside a 5-step run
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True, stop_token_ids=[r[j]])
              for p, r, j in zip(free, ref, (7, 3, 12, 8, 21, 6))]
    params[1] = SamplingParams(temperature=0.9, max_tokens=4, seed=4)
    runs, covered = [], []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: covered.append((schedule(), len(scheduler.running))) or covered[-1][0]
    assert scheduler.prompts_alone
    for k, interrupt, alone in ((1, None, False), (5, None, True), (5, lambda: next(calls) % 3 == 2, True)):
        calls = iter(range(10**6))
        scheduler.num_steps, llm.engine.worker.runner.interrupt, scheduler.prompts_alone = k, interrupt, alone
        n = len(covered)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        # steps of joining prompts only, while others ran: in the runs with prompts alone
        alone_steps = sum(1 for s, running in covered[n:] if s.num_decode == 0 and len(s.requests) < running)
        assert (alone_steps > 0) == alone
    assert runs[0] == runs[1] == runs[2]
    for (tokens, reason), r, p in zip(runs[1], ref, params):
        if p.temperature == 0:
            assert reason == "stop" and tokens == r[:r.index(p.stop_token_ids[0]) + 1]
    assert max(s.num_steps for s, _ in covered) == 5


def test_kv_connector_saves_the_blocks_a_multi_step_run_completed():
    """The EMS connector's saves, built at schedule time, cover the blocks the last run's later
    steps completed (their KV is in place by the next step), each once."""
    from matrixinfer.config import KVTransferConfig
    from matrixinfer.kv_connector.ems_connector import EMSConnectorScheduler

    class NoPool:
        def exists(self, keys):
            return [False] * len(keys)

    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, 64, EMSConnectorScheduler(KVTransferConfig(), kv, NoPool()), num_steps=6)
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
    sched.add_request(req)
    saved = []
    for new in ([7], [8, 9, 5, 6, 4, 1], [2, 3, 3, 3, 3, 3], [5]):
        step = sched.schedule()
        saved.append((step.num_steps, [b for b, _ in step.kv_connector_metadata.saves]))
        sched.update_from_output(step, ModelRunnerOutput(["r"], new[:1], new_token_ids=[new]))
    # the prefill completes nothing; the first run (positions 3 ... 8) completes block 0 at its
    # first step and block 1 at its fifth: block 0 saved with it, block 1 with the next run,
    # whose steps (9 ... 14) complete block 2, saved with the run after, whose first step
    # (position 15) completes block 3 too
    b = req.block_table
    assert saved == [(1, []), (6, [b[0]]), (6, [b[1]]), (6, [b[2], b[3]])]


def test_a_grammar_request_takes_single_steps_and_sends_its_output():
    """A greedy request with a grammar (structured outputs) is not run k steps at a time: its
    tokens come from the masked sampler, and each step carries its output for the matcher."""
    from matrixinfer.engine.sampling_params import StructuredOutputsParams

    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, num_steps=4)
    _decoding(sched, "g", SamplingParams(temperature=0, max_tokens=20))
    assert sched.schedule().num_steps == 4
    _decoding(sched, "j", SamplingParams(temperature=0, max_tokens=20,
                                         structured_outputs=StructuredOutputsParams(json_object=True)))
    step = sched.schedule()
    assert step.num_steps == 1
    assert {r.request_id: r.output_token_ids for r in step.requests}["j"] == [7]
