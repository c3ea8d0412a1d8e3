"""vLLM's sampling extensions and OpenAI's penalties, sent over HTTP to the bundled model
(models/matrixinfer-tiny-moe, trained on Python code): each one changes the text the way it
should, not merely passes validation."""

import httpx
import pytest

from matrixinfer.serving import build_app
from tests.serving.conftest import LiveServer

PROMPT = "import os\n\n\ndef read_lines(path):\n"


@pytest.fixture(scope="module")
def bundled(bundled_engine):
    server = LiveServer(build_app(bundled_engine))
    yield server.url, bundled_engine.tokenizer
    server.stop()


def complete(url, **body):
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_logit_bias_forces_and_bans_tokens(bundled):
    """+100 on one token makes it every token; -100 on the greedy first token changes the text."""
    url, tok = bundled
    forced = ids_of(tok, "x")[-1]
    text = complete(url, logit_bias={str(forced): 100}, max_tokens=5)[0]["text"]
    assert text == tok.decode([forced] * 5)
    greedy = complete(url)[0]["text"]
    first = ids_of(tok, PROMPT + greedy)[len(ids_of(tok, PROMPT))]
    assert complete(url, logit_bias={str(first): -100})[0]["text"] != greedy


def test_repetition_frequency_and_presence_penalties_reduce_repeats(bundled):
    """Greedy code repeats tokens; each penalty yields a different text with more distinct
    tokens than the unpenalised one."""
    url, tok = bundled
    base = complete(url, max_tokens=48)[0]["text"]
    distinct = lambda text: len(set(ids_of(tok, text)))  # noqa: E731
    for penalty in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        text = complete(url, max_tokens=48, **penalty)[0]["text"]
        assert text != base and distinct(text) > distinct(base), penalty


def test_top_k_1_and_min_p_1_are_greedy_and_seed_reproduces(bundled):
    """At temperature 1, top_k=1 or min_p=1 leave only the most likely token (the greedy
    text); a seed makes sampling reproducible and another seed differs."""
    url, _ = bundled
    greedy = complete(url)[0]["text"]
    assert complete(url, temperature=1.0, top_k=1, seed=5)[0]["text"] == greedy
    assert complete(url, temperature=1.0, min_p=1.0, seed=5)[0]["text"] == greedy
    a, b = (complete(url, temperature=1.0, seed=s, max_tokens=32)[0]["text"] for s in (7, 7))
    assert a == b and complete(url, temperature=1.0, seed=8, max_tokens=32)[0]["text"] != a


def test_stop_token_ids_min_tokens_and_include_stop_str(bundled):
    """A stop token id ends the choice at its first occurrence (its text is kept, as in vLLM,
    unless it is a special token) unless min_tokens asks for more; include_stop_str_in_output
    keeps a stop string in the text."""
    url, tok = bundled
    greedy = complete(url)[0]["text"]
    gen = ids_of(tok, PROMPT + greedy)[len(ids_of(tok, PROMPT)):]
    stop_id = gen[0]
    first = complete(url, stop_token_ids=[stop_id])[0]
    assert first["finish_reason"] == "stop" and first["stop_reason"] == stop_id
    assert first["text"] == tok.decode([stop_id])
    later = complete(url, stop_token_ids=[stop_id], min_tokens=3, logprobs=0)[0]
    assert len(later["logprobs"]["tokens"]) >= 3
    stop = greedy[5:8]
    plain = complete(url, stop=[stop])[0]["text"]
    kept = complete(url, stop=[stop], include_stop_str_in_output=True)[0]["text"]
    assert kept == plain + stop and not plain.endswith(stop)


def test_ignore_eos_and_skip_special_tokens(bundled):
    """With eos forced by logit_bias, the choice ends at once; with ignore_eos it goes on to
    max_tokens, and skip_special_tokens=false shows the eos tokens in the text."""
    url, tok = bundled
    eos = {str(tok.eos_token_id): 100}
    stopped = complete(url, logit_bias=eos)[0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == ""
    kept = complete(url, logit_bias=eos, ignore_eos=True, max_tokens=4)[0]
    assert kept["finish_reason"] == "length" and kept["text"] == ""
    shown = complete(url, logit_bias=eos, ignore_eos=True, max_tokens=4, skip_special_tokens=False)[0]["text"]
    assert shown == tok.decode([tok.eos_token_id] * 4, skip_special_tokens=False) and shown
