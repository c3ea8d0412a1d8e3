"""The offline LLM API end to end on a tiny checkpoint with a real tokenizer: sampling
options, stops, streaming, n > 1, prefix caching, preemption."""

import math

import pytest
import torch

from matrixinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(text_checkpoint):
    return LLM(model=text_checkpoint[0], dtype="float32", block_size=4)


def test_text_prompts_in_input_order(llm):
    """Strings and token-id dicts mix; results come back in input order with text and token ids."""
    tok = llm.get_tokenizer()
    prompts = ["def add(a, b):", {"prompt_token_ids": tok.encode("for i in")}, "class Point:"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["def add(a, b):", None, "class Point:"]
    for o in outs:
        assert len(o.outputs[0].token_ids) == 24
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
    single = llm.generate("class Point:", GREEDY, use_tqdm=False)[0]
    assert single.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    a = llm.generate("def", p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate("def", p, use_tqdm=False)[0].outputs[0].token_ids
    c = llm.generate("def", SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and a != c


def test_top_k_one_is_greedy(llm):
    g = llm.generate("for i", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    k1 = llm.generate("for i", SamplingParams(temperature=0.8, top_k=1, seed=1, max_tokens=24, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0].token_ids
    assert g == k1


def test_stop_token_ids_and_max_tokens(llm):
    full = llm.generate("def add", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    out = llm.generate("def add", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    short = llm.generate("def add", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert short[0].outputs[0].finish_reason == "length" and len(short[0].outputs[0].token_ids) == 3


def test_min_tokens_masks_stops_only_until_reached(llm):
    """min_tokens=1 masks the stop ids at the first output position only: a stop token first
    produced later still ends the output there (once the worker saw no output count without
    penalties and masked the stop ids at every step)."""
    full = llm.generate("def add", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = next(t for t in full.token_ids if t != full.token_ids[0])  # first produced at position >= 1
    first = full.token_ids.index(stop_tok)
    out = llm.generate("def add", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=1,
                                                 stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"


def test_stop_string_truncates_text(llm):
    full = llm.generate("class", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    out = llm.generate("class", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llm.generate("class", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert incl.text == full.text[: full.text.find(stop) + len(stop)]


def test_logprobs_are_the_model_distribution(llm):
    """Returned logprobs are log-softmax of the model's logits: the greedy token is the top-1."""
    out = llm.generate("def", SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert max(lp.top, key=lp.top.get) == tok and lp.logprob <= 0
        assert sum(math.exp(v) for v in lp.top.values()) <= 1 + 1e-5
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_n_samples_per_request(llm):
    outs = llm.generate("def", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1


def test_streaming_iterator_grows_to_the_final_output(llm):
    final = llm.generate("for i in", GREEDY, use_tqdm=False)[0].outputs[0]
    seen = [o.outputs[0].token_ids for o in llm.generate_stream("for i in", GREEDY)]
    assert [len(s) for s in seen] == list(range(1, 25))
    assert seen[-1] == final.token_ids


def test_final_only_reports_once_per_request_and_generate_uses_it(llm):
    """RequestOutputKind.FINAL_ONLY: steps build no output for an unfinished request, one
    when it finishes, with everything the cumulative kind ends with; generate() asks for it
    without changing the caller's params."""
    from matrixinfer.engine.sampling_params import RequestOutputKind

    engine = llm.engine
    final_only = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("fo-a", "for i in", final_only)
    engine.add_request("fo-b", "def", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen = {"fo-a": [], "fo-b": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["fo-a"]) == 1 and seen["fo-a"][0].finished and len(seen["fo-a"][0].outputs[0].token_ids) == 6
    assert len(seen["fo-b"]) == 6
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate("for i in", params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == seen["fo-a"][0].outputs[0].token_ids
    assert out.outputs[0].text == seen["fo-a"][0].outputs[0].text
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_prefix_cache_hit_gives_identical_output(text_checkpoint):
    """A repeated long prompt is served mostly from cached blocks, with the same greedy output;
    another namespace gets no hit."""
    llm = LLM(model=text_checkpoint[0], dtype="float32", block_size=4)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    a = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    b = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    c = llm.generate(prompt, GREEDY, use_tqdm=False, namespace="other")[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 56 and c.num_cached_tokens == 0
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_preemption_under_cache_pressure_gives_same_tokens(text_checkpoint):
    """With a cache too small for all sequences at once, sequences are preempted and recomputed
    (never a crash) and greedy outputs equal those of an ample cache."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (20,), generator=g).tolist()} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ample = LLM(model=text_checkpoint[0], dtype="float32", block_size=4).generate(prompts, params, use_tqdm=False)
    tight = LLM(model=text_checkpoint[0], dtype="float32", block_size=4, num_blocks=40, max_model_len=128)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ample]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-5), dict(max_tokens=0),
                                 dict(n=0), dict(min_p=2), dict(stop=[""])])
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_prompt_longer_than_context_is_rejected(text_checkpoint):
    llm = LLM(model=text_checkpoint[0], dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="context is 64"):
        llm.generate({"prompt_token_ids": [5] * 64}, GREEDY, use_tqdm=False)
