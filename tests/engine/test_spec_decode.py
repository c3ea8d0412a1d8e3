"""MTP speculative decoding end to end: greedy output is token-identical to decoding without
speculation (oracle configs with an MTP module added, the bundled model; with chunked prefill,
prefix caching, preemption, k > 1), stops and max_tokens hold when several tokens arrive at
once, and the acceptance counters add up."""

import dataclasses
import json

import pytest
import torch

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.loader import load_model
from matrixinfer.model.saver import save_pretrained

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
CODE = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
        "for i in range(10):"]


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def bundled_greedy():
    """Greedy outputs of the bundled model without speculation (small blocks, chunked prefill)."""
    return token_ids(LLM(model=DEFAULT_MODEL, dtype="float32", block_size=4, max_num_batched_tokens=16), CODE)


@pytest.mark.parametrize("k", [1, 2])
def test_bundled_model_greedy_is_token_identical(bundled_greedy, k):
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", block_size=4, max_num_batched_tokens=16, speculative_config=mtp(k))
    assert token_ids(llm, CODE) == bundled_greedy
    s = llm.engine.stats
    assert s.spec_num_draft_tokens > 0 and 0 < s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
    assert len(s.spec_accepted_per_pos) == k and sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    assert s.spec_accepted_per_pos == sorted(s.spec_accepted_per_pos, reverse=True)  # position i needs i - 1 first
    assert s.mean_acceptance_length == pytest.approx(1 + s.spec_num_accepted_tokens / s.spec_num_drafts)
    # a step yields up to 1 + k tokens: fewer steps than tokens
    assert s.steps < sum(map(len, bundled_greedy))


@pytest.fixture(scope="module")
def oracle_with_mtp(hf_checkpoint, tmp_path_factory):
    """The oracle checkpoint (transformers drops MTP weights) plus a random MTP module."""
    path, _ = hf_checkpoint
    base = load_model(path, dtype="float32")
    cfg = dataclasses.replace(base.config, num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = DeepseekForCausalLM(cfg)
    missing, _ = model.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in missing and p.dim() >= 2:
                p.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("oracle-mtp")
    hf_config = json.loads((path / "config.json").read_text())
    save_pretrained(model, out, {**hf_config, "num_nextn_predict_layers": 1}, dtype=torch.float32)
    (out / "generation_config.json").write_text("{}")
    return out


def test_oracle_configs_greedy_is_token_identical(oracle_with_mtp):
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(2, 97, (n,), generator=g).tolist()} for n in (5, 17, 9, 30)]
    kw = dict(dtype="float32", block_size=4, max_num_batched_tokens=24)
    ref = token_ids(LLM(model=oracle_with_mtp, **kw), prompts)
    for k in (1, 3):
        llm = LLM(model=oracle_with_mtp, speculative_config=mtp(k), **kw)
        assert token_ids(llm, prompts) == ref
        assert llm.engine.stats.spec_num_draft_tokens > 0


def test_prefix_cache_hit_and_preemption_keep_greedy_output(bundled_greedy):
    """A repeated prompt hits the prefix cache (blocks named while speculating); a cache too small
    for all sequences preempts and recomputes them; the output does not change."""
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", block_size=4, num_blocks=28, max_model_len=96,
              max_num_batched_tokens=16, speculative_config=mtp(2))
    assert token_ids(llm, CODE) == bundled_greedy
    assert llm.engine.stats.num_preemptions > 0
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", block_size=4, speculative_config=mtp(2))
    first, again = (llm.generate(CODE[2], GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == bundled_greedy[2]


def test_stop_ids_and_max_tokens_cut_inside_an_accepted_run(bundled_greedy):
    """The bundled model repeats itself, so most steps accept their drafts: a stop id or the
    max_tokens limit falls inside a multi-token step and the tokens after it are dropped."""
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", speculative_config=mtp(3))
    full = bundled_greedy[1]
    stop = full[7]
    out = llm.generate(CODE[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(stop) + 1] and out.finish_reason == "stop"
    for n in (1, 5, 6, 7):
        short = llm.generate(CODE[1], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert short.token_ids == full[:n] and short.finish_reason == "length"
    assert llm.engine.stats.mean_acceptance_length > 2


def test_stop_string_with_several_tokens_per_step(bundled_greedy):
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", speculative_config=mtp(3))
    text = llm.get_tokenizer().decode(bundled_greedy[1])
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = llm.generate(CODE[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"


def test_sampling_with_a_seed_is_reproducible_and_penalties_mix_in():
    """Sampled rows verify by rejection sampling; a seeded request repeats itself; a request with
    penalties or logprobs takes the plain sampler in the same batches."""
    llm = LLM(model=DEFAULT_MODEL, dtype="float32", speculative_config=mtp(2))
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, logprobs=2)
    a = llm.generate(CODE, p, use_tqdm=False)
    b = llm.generate(CODE[:2] + [CODE[2]], [p, plain, p], use_tqdm=False)
    assert b[0].outputs[0].token_ids == a[0].outputs[0].token_ids
    assert b[2].outputs[0].token_ids == a[2].outputs[0].token_ids
    ref = LLM(model=DEFAULT_MODEL, dtype="float32").generate(CODE[1], plain, use_tqdm=False)[0].outputs[0]
    assert b[1].outputs[0].token_ids == ref.token_ids and len(b[1].outputs[0].logprobs) == 30


def test_rejected_drafts_roll_back_and_block_names_cover_accepted_tokens_only():
    from matrixinfer.config import SchedulerConfig
    from matrixinfer.engine.kv_cache_manager import KVCacheManager
    from matrixinfer.engine.request import Request
    from matrixinfer.engine.scheduler import ModelRunnerOutput, Scheduler

    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, num_spec_tokens=2)
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
    sched.add_request(req)
    step = sched.schedule()
    assert step.requests[0].spec and step.requests[0].num_draft == 0
    sched.update_from_output(step, ModelRunnerOutput(["r"], [7], new_token_ids=[[7]], draft_token_ids=[[8, 9]]))
    step = sched.schedule()
    row = step.requests[0]
    assert (row.token_ids, row.start_pos, row.num_draft, step.num_decode) == ([7, 8, 9], 3, 2, 1)
    assert len(row.block_table) == 2  # positions 3..5, and one lookahead slot for the second draft
    # draft 8 accepted, draft 9 rejected: the target's own token there is 5
    sched.update_from_output(step, ModelRunnerOutput(["r"], [8], new_token_ids=[[8, 5]], draft_token_ids=[[6, 6]]))
    assert req.output_token_ids == [7, 8, 5] and req.num_computed_tokens == 5
    s = sched.stats
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_accepted_per_pos) == \
        (1, 2, 1, [1, 0])
    step = sched.schedule()
    assert (step.requests[0].token_ids, step.requests[0].start_pos) == ([5, 6, 6], 5)  # 9's slot is written again
    sched.update_from_output(step, ModelRunnerOutput(["r"], [6], new_token_ids=[[6, 6, 4]], draft_token_ids=[[1, 1]]))
    assert req.num_computed_tokens == 8
    assert [kv.blocks[b].token_ids for b in req.block_table[:2]] == [[1, 2, 3, 7], [8, 5, 6, 6]]
    assert kv.blocks[req.block_table[2]].hash is None


def test_kv_connector_saves_only_blocks_of_accepted_tokens():
    """The EMS connector saves the blocks a step completes: drafts do not count until accepted,
    and a block the accepted drafts completed is saved on the next step."""
    from matrixinfer.config import KVTransferConfig, SchedulerConfig
    from matrixinfer.engine.kv_cache_manager import KVCacheManager
    from matrixinfer.engine.request import Request
    from matrixinfer.engine.scheduler import ModelRunnerOutput, Scheduler
    from matrixinfer.kv_connector.ems_connector import EMSConnectorScheduler

    class NoPool:
        def exists(self, keys):
            return [False] * len(keys)

    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, 64, EMSConnectorScheduler(KVTransferConfig(), kv, NoPool()), 2)
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
    sched.add_request(req)
    saved = []
    for new, drafts in [([7], [8, 9]), ([8, 9, 5], [6, 6]), ([6, 4], [1, 1]), ([1], [])]:
        step = sched.schedule()
        saved.append([b for b, _ in step.kv_connector_metadata.saves])
        sched.update_from_output(step, ModelRunnerOutput(["r"], new[:1], new_token_ids=[new], draft_token_ids=[drafts]))
    # step 2 completes block 0 with its first (known) token; step 3's drafts would complete block 1
    # but only one was accepted (positions 4..7 = 8, 9, 5, 6 are KV after it); step 4 saves block 1
    assert saved == [[], [req.block_table[0]], [], [req.block_table[1]]]


def test_a_sequence_runs_to_the_context_limit_in_a_cache_sized_for_it():
    """Drafts stop at max_model_len and the k - 1 lookahead slots are part of a sequence's size:
    a cache holding exactly one sequence (and its lookahead) serves it to the end; one block
    less is refused at start, not a crash mid-generation."""
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, max_model_len=64)
    ref = LLM(model=DEFAULT_MODEL, num_blocks=16, **kw).generate(CODE[1], p, use_tqdm=False)[0].outputs[0]
    out = LLM(model=DEFAULT_MODEL, num_blocks=17, speculative_config=mtp(3), **kw).generate(
        CODE[1], p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    with pytest.raises(ValueError, match="lookahead"):
        LLM(model=DEFAULT_MODEL, num_blocks=16, speculative_config=mtp(3), **kw)
