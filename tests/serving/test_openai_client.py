"""The official `openai` client against a live server on loopback: the API is OpenAI's as far
as a real client can tell (completions and chat, stream and non-stream, n > 1, stop strings,
logprobs, usage)."""

import httpx
import openai
import pytest

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def client(service):
    server, _, _ = service
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-no-keys-configured", max_retries=0, timeout=60)


def _greedy(client, **kw):
    return client.completions.create(model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_models_lists_the_served_model(client):
    """GET /v1/models names the served model, as the client's models.list() expects."""
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_non_stream_has_text_and_usage(client):
    """A completion returns text, finish_reason=length at max_tokens and full usage."""
    r = _greedy(client, max_tokens=8)
    assert r.object == "text_completion" and r.model == "tiny" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_concatenates_to_the_non_stream_text(client):
    """Streamed chunks of a greedy completion add up to the non-streamed text; the stream ends
    with usage when include_usage is set."""
    full = _greedy(client, max_tokens=12).choices[0].text
    chunks = list(_greedy(client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_choices(client):
    """n > 1 gives n indexed choices, and usage counts the tokens of all of them."""
    r = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=5, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    streamed = client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=4, stream=True,
                                         extra_body={"ignore_eos": True})
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_stop_string_cuts_text_in_both_modes(client):
    """A stop string taken from the greedy text ends the completion just before it, streamed
    or not; finish_reason is stop."""
    full = _greedy(client, max_tokens=24).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 1) if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    cut = full[:full.index(stop)]
    r = _greedy(client, max_tokens=24, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = [c for c in _greedy(client, max_tokens=24, stop=stop, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    """logprobs=k returns one logprob per token and k alternatives, the sampled one among them
    under greedy decoding."""
    r = _greedy(client, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert all(abs(max(top.values()) - v) < 1e-4 for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_non_stream_and_logprobs(client, service):
    """Chat applies the tokenizer's chat template and answers as the assistant, with logprobs
    in the chat shape when asked."""
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert len(choice.logprobs.content) == 6 and all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    tokenized = httpx.post(service[0].url + "/tokenize", json={"messages": [{"role": "user", "content": "hello"}]})
    assert r.usage.prompt_tokens == tokenized.json()["count"] and r.usage.completion_tokens == 6


def test_chat_stream_matches_non_stream(client):
    """A streamed chat starts with the assistant role and adds up to the non-streamed answer."""
    kw = dict(model="tiny", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
              max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 10


def test_seeded_sampling_is_reproducible(client):
    """The same seed gives the same sampled text."""
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=11,
              extra_body={"ignore_eos": True})
    kw["extra_body"]["top_k"] = kw.pop("top_k")
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_vanishing_top_p_keeps_the_top_token(client):
    """top_p so small it rounds to 0 in float32 still samples (the most likely token), found by
    the fuzzer: it once left no token to sample from."""
    greedy = _greedy(client, max_tokens=4).choices[0].text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, top_p=5e-324,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy


def test_chat_prompt_carries_the_templates_bos_once(client, engine):
    """The chat template places bos itself (as DeepSeek's does); the server must not add a
    second one when it tokenizes the templated text."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
