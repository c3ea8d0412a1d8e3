"""The rest of OpenAI's completions surface, over HTTP: batched prompts, echo, best_of,
suffix and JSON mode refused with a clear 400, usage in streams, `user`; and the exact
request `vllm bench serve --backend openai` sends."""

import json

import httpx
import pytest

PROMPT = [40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def post(service):
    url = service[0].url

    def post(body, path="/v1/completions"):
        return httpx.post(url + path, json={"max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}, timeout=60)

    return post


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_prompts_number_choices_per_prompt_times_n(post):
    """A list of prompts (text or token ids) gives n choices per prompt, index = prompt * n + j,
    each the same as that prompt alone; usage counts every prompt."""
    alone = [_ok(post({"prompt": p}))["choices"][0]["text"] for p in (PROMPT, [50, 51, 52])]
    body = _ok(post({"prompt": [PROMPT, [50, 51, 52]], "n": 2}))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert body["usage"]["prompt_tokens"] == 8 and body["usage"]["completion_tokens"] == 16
    texts = _ok(post({"prompt": ["ab", "cd"]}))["choices"]
    assert [c["index"] for c in texts] == [0, 1]


def test_batched_prompts_stream(post, service):
    """Streamed, a batch's chunks carry each choice's index and add up to the non-streamed text."""
    want = [c["text"] for c in _ok(post({"prompt": [PROMPT, [50, 51, 52]]}))["choices"]]
    got = ["", ""]
    with httpx.stream("POST", service[0].url + "/v1/completions", timeout=60,
                      json={"prompt": [PROMPT, [50, 51, 52]], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        for choice in c["choices"]:
            got[choice["index"]] += choice["text"]
    assert got == want and chunks[-1]["usage"]["completion_tokens"] == 8


def test_echo_prefixes_the_prompt(post, service):
    """echo puts the prompt's text before the completion, streamed or not."""
    plain = _ok(post({"prompt": "def f("}))["choices"][0]["text"]
    assert _ok(post({"prompt": "def f(", "echo": True}))["choices"][0]["text"] == "def f(" + plain
    with httpx.stream("POST", service[0].url + "/v1/completions", timeout=60,
                      json={"prompt": "def f(", "echo": True, "stream": True, "max_tokens": 4, "temperature": 0,
                            "ignore_eos": True}) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == "def f(" + plain


def test_best_of_returns_the_n_most_likely(post):
    """best_of=4, n=2: two choices, those of highest cumulative logprob among four sampled
    ones; every generated token is metered. best_of < n or streamed is a 400."""
    body = _ok(post({"prompt": PROMPT, "best_of": 4, "n": 2, "temperature": 1.0, "seed": 11, "logprobs": 0}))
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 16
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in body["choices"]]
    assert sums == sorted(sums, reverse=True)
    four = _ok(post({"prompt": PROMPT, "n": 4, "temperature": 1.0, "seed": 11, "logprobs": 0}))["choices"]
    assert max(sum(c["logprobs"]["token_logprobs"]) for c in four) == pytest.approx(sums[0], abs=1e-4)
    assert post({"prompt": PROMPT, "best_of": 1, "n": 2}).json()["error"]["param"] == "best_of"
    assert post({"prompt": PROMPT, "best_of": 3, "stream": True}).status_code == 400


@pytest.mark.parametrize("body,param", [
    ({"suffix": "return x"}, "suffix"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": [[1, 2], []]}, "prompt.1"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 9, "max_tokens": 4}, None),
])
def test_unsupported_or_bad_options_are_clear_400s(post, body, param):
    """What cannot be honoured is refused with a 400 naming the field, never ignored."""
    r = post({"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_chat_accepts_text_response_format_and_refuses_json_schema_without_a_schema(post):
    """Chat: response_format text is fine; json_schema with no schema is a 400 (structured
    outputs themselves: tests/serving/test_structured_http.py)."""
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    assert post({**msgs, "response_format": {"type": "text"}}, "/v1/chat/completions").status_code == 200
    r = post({**msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema"


def test_vllm_bench_serve_request_shape_is_served(service):
    """The body `vllm bench serve --backend openai` posts (vllm 0.33,
    benchmarks/lib/endpoint_request_func.py): repetition_penalty 1.0, logprobs null, a stream
    with usage, ignore_eos; with a `user` too. Every chunk parses and usage comes last."""
    body = {"model": "tiny", "prompt": "def add(a, b):", "repetition_penalty": 1.0, "max_tokens": 6,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "user": "bench", "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    with httpx.stream("POST", service[0].url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" in c for c in chunks)
