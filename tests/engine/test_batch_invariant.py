"""Batch-invariant mode (model/batch_invariant.py): each request's greedy tokens and logprobs are
bitwise those of its solo run, whatever it is batched with, however its prompt is chunked
(a 32-token step budget cuts the longer prompts into chunks that share steps with decode
rows), after a prefix-cache hit (prompts share prefixes, and the solo runs come after), and
after preemption (too few KV blocks for all of them at once). On the bundled checkpoint in
its own dtype (bfloat16, where the default mode is not batch-invariant: a different batch
changes the sums' order, and a later greedy token), on the compiled default path, and in
float32 eagerly."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixinfer import LLM, SamplingParams

PROMPTS = [
    "import os\n\n\ndef read_lines(path):\n",
    "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n\n\n"
    "def write_lines(path, lines):\n",
    "class Stack:\n    def __init__(self):\n",
    "def fib(n):\n",
    "# sort a list of numbers and print the largest three\nitems = [3, 1, 2, 9, 7]\n",
    "for i in range(10):\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
MAX_TOKENS = 40
# too few blocks for every prompt at once (8 x ~60-90 tokens at 16 a block): later ones preempt
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=28, block_size=16, max_model_len=256)


def _tokens(llm, indices, max_tokens=MAX_TOKENS, logprobs=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([PROMPTS[i] for i in indices], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _lp_values(logprobs):
    return [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in logprobs]


@pytest.fixture(scope="module")
def compiled_bf16():
    llm = LLM(dtype="bfloat16", batch_invariant=True, enforce_eager=False, **LIMITS)
    solo = [_tokens(llm, [i])[0][0] for i in range(len(PROMPTS))]
    yield llm, solo
    llm.shutdown()


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=8),
       max_tokens=st.integers(8, MAX_TOKENS))
def test_compiled_bf16_tokens_equal_solo_in_any_batch(compiled_bf16, batch, max_tokens):
    llm, solo = compiled_bf16
    got = _tokens(llm, batch, max_tokens)
    for i, (tokens, _) in zip(batch, got):
        assert tokens == solo[i][:max_tokens], f"prompt {i} in batch {batch}"


@pytest.mark.slow
def test_compiled_bf16_logprobs_equal_solo_in_a_full_batch(compiled_bf16):
    """The sampler's path (logprobs asked: no multi-step run, no in-graph argmax): every
    request's tokens and logprob values, bitwise, alone and among all the others."""
    llm, _ = compiled_bf16
    alone = [_tokens(llm, [i], 16, logprobs=2)[0] for i in range(len(PROMPTS))]
    together = _tokens(llm, list(range(len(PROMPTS))), 16, logprobs=2)
    for i, ((t1, lp1), (t2, lp2)) in enumerate(zip(alone, together)):
        assert t1 == t2, f"prompt {i}"
        assert _lp_values(lp1) == _lp_values(lp2), f"prompt {i}: logprobs differ"


def test_eager_float32_tokens_equal_solo_in_any_batch():
    llm = LLM(dtype="float32", batch_invariant=True, enforce_eager=True, **LIMITS)
    try:
        solo = [_tokens(llm, [i], 24)[0][0] for i in range(len(PROMPTS))]
        for batch in ([0, 1, 2, 3, 4, 5, 6, 7], [7, 1, 1, 3], [5, 0]):
            for i, (tokens, _) in zip(batch, _tokens(llm, batch, 24)):
                assert tokens == solo[i], f"prompt {i} in batch {batch}"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_the_non_speculative_tokens_in_bfloat16(k):
    """With the mode, speculation cannot change a greedy token even in bfloat16: a verify row is a
    decode row whose context holds the drafts before it, so its logits are those of the decode
    step that would have made that token (without the mode, only float32 promises this)."""
    kw = dict(dtype="bfloat16", batch_invariant=True, enforce_eager=True, **LIMITS)
    plain = LLM(**kw)
    want = [t for t, _ in _tokens(plain, list(range(len(PROMPTS))), 24)]
    plain.shutdown()
    llm = LLM(**kw, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    try:
        assert [t for t, _ in _tokens(llm, list(range(len(PROMPTS))), 24)] == want
        s = llm.engine.stats
        assert 0 < s.spec_num_accepted_tokens <= s.spec_num_draft_tokens  # it did speculate, and drafts landed
    finally:
        llm.shutdown()


def test_the_mode_shows_in_the_layout_and_runners_without_it_refuse_it():
    from matrixinfer.config import EngineConfig

    cfg = EngineConfig.from_kwargs("m", batch_invariant=True)
    assert "batch-invariant" in cfg.layout() and not cfg.compiles_prefill  # prompts run the decode graph
    with pytest.raises(ValueError, match="batch_invariant with expert parallelism"):
        EngineConfig.from_kwargs("m", batch_invariant=True, expert_parallel_size=2)
