"""SamplingParams(prompt_logprobs=N) with vLLM's semantics: RequestOutput.prompt_logprobs is
None for the first prompt token, then per position a dict holding the actual prompt token and
the N most likely, equal to log-softmax of the dense float model's logits over the prompt,
whatever the chunking of the prefill and whatever the prefix cache holds."""

import pytest
import torch

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import DEFAULT_MODEL, SchedulerConfig
from matrixinfer.engine.kv_cache_manager import KVCacheManager
from matrixinfer.engine.request import Request
from matrixinfer.engine.scheduler import Scheduler
from matrixinfer.model.loader import load_model

TOL = 1e-4
PROMPTS = [[3 + (7 * i) % 200 for i in range(29)], [3 + (11 * i) % 200 for i in range(13)]]


@pytest.fixture(scope="module")
def llm():
    # 8 tokens per step: the 29-token prompt is prefilled in 4 chunks, the two prompts share steps
    return LLM(model=DEFAULT_MODEL, dtype="float32", block_size=4, max_num_batched_tokens=8,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def dense():
    return load_model(DEFAULT_MODEL, dtype="float32")


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len-1, vocab]: row i is the dense model's log-distribution of prompt token i + 1."""
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([prompt]), torch.arange(len(prompt))[None]))[0]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, n: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:]):
        tok = prompt[i + 1]
        top = ref[i].topk(n)
        assert set(entry) == {tok, *top.indices.tolist()}
        assert abs(entry[tok].logprob - ref[i, tok].item()) < TOL
        assert entry[tok].rank == int((ref[i] > ref[i, tok]).sum()) + 1
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t].logprob - v) < TOL


def test_prompt_logprobs_equal_the_dense_model_across_chunks(llm, dense):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        check(out.prompt_logprobs, prompt, reference(dense, prompt), 3)
        assert out.outputs[0].logprobs is None  # prompt logprobs do not turn on sample logprobs


def test_cached_prefix_is_recomputed_for_prompt_logprobs(llm, dense):
    """A repeated prompt hits the prefix cache, except when prompt logprobs are asked: a cached
    prefix has no logits (as in vLLM)."""
    prompt = PROMPTS[0]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    again = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and plain[0].prompt_logprobs is None
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, prompt, reference(dense, prompt), 0)
    assert out.outputs[0].token_ids == again[0].outputs[0].token_ids


def test_negative_prompt_logprobs_is_rejected():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


class CountingConnector:
    """The scheduler half of a KV connector that would serve any prompt from its pool."""
    def __init__(self):
        self.asked = []

    def get_num_new_matched_tokens(self, req, num_computed_tokens):
        self.asked.append(req.request_id)
        return 0

    def build_connector_meta(self, out, reqs):
        return None


def test_connector_is_not_asked_for_prompt_logprobs_requests():
    connector = CountingConnector()
    sched = Scheduler(SchedulerConfig(), KVCacheManager(16, 4), 64, connector)
    sched.add_request(Request("plain", PROMPTS[1], SamplingParams()))
    sched.add_request(Request("scored", PROMPTS[1], SamplingParams(prompt_logprobs=1)))
    out = sched.schedule()
    assert connector.asked == ["plain"]
    scored = next(r for r in out.requests if r.request_id == "scored")
    assert scored.prompt_logprobs == 1 and scored.next_prompt_token_ids == PROMPTS[1][1:]
