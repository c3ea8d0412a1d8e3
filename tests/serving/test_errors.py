"""Bad requests get HTTP 400 (404 for an unknown model) with OpenAI's error body, naming the
field at fault; a prompt longer than the context says the limit."""

import httpx
import pytest


@pytest.fixture(scope="module")
def post(service):
    url = service[0].url

    def post(path, body, **kw):
        return httpx.post(url + path, json=body, timeout=30, **kw)

    return post


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_unknown_field_is_named(post):
    """An unknown parameter is refused, not ignored, and the error names it."""
    err = _error(post("/v1/completions", {"prompt": "x", "max_tokens": 2, "frequency_penaltyy": 0}), 400)
    assert err["param"] == "frequency_penaltyy" and "frequency_penaltyy" in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("n", 0), ("max_tokens", 0),
                                         ("logprobs", 6), ("stream", "maybe"), ("seed", -5)])
def test_invalid_value_names_the_field(post, field, value):
    """An out-of-range or mistyped value is a 400 whose param is that field."""
    err = _error(post("/v1/completions", {"prompt": "x", "max_tokens": 2, field: value}), 400)
    assert err["param"] == field


def test_chat_message_errors_name_the_path(post):
    """Errors inside messages name the path to the bad part."""
    err = _error(post("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}), 400)
    assert err["param"] == "messages.0.role"
    err = _error(post("/v1/chat/completions", {"messages": []}), 400)
    assert err["param"] == "messages"
    err = _error(post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
                 400)
    assert err["param"] == "top_logprobs"


def test_prompt_longer_than_context_says_the_limit(post):
    """A prompt over the context is a 400 that says the limit (128 tokens here)."""
    err = _error(post("/v1/completions", {"prompt": list(range(2, 202))}), 400)
    assert "128" in err["message"] and err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    err = _error(post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 200}), 400)
    assert "128" in err["message"] and err["param"] == "max_tokens"


def test_other_prompt_errors(post, service):
    """Token ids outside the vocabulary, an empty prompt, too many stop strings, and JSON that
    does not parse are all 400s."""
    assert _error(post("/v1/completions", {"prompt": [5, 100000]}), 400)["param"] == "prompt"
    assert _error(post("/v1/completions", {"prompt": []}), 400)["param"] == "prompt"
    assert _error(post("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), 400)["param"] == "stop"
    assert _error(post("/v1/completions", {"prompt": "x", "stop": [""]}), 400)["param"] == "stop"
    r = httpx.post(service[0].url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    _error(r, 400)


def test_unknown_model_is_404(post):
    """Asking for a model this server does not serve is OpenAI's 404 model_not_found."""
    err = _error(post("/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_unknown_route_has_an_openai_error_body(service):
    """Even a 404 route answers with the error shape clients parse."""
    _error(httpx.get(service[0].url + "/v1/nothing-here"), 404)


def test_tokenize_and_detokenize_round_trip(post):
    """/tokenize and /detokenize are inverse on text, and /tokenize reports the context limit."""
    toks = post("/tokenize", {"prompt": "for i in range(10):", "add_special_tokens": False}).json()
    assert toks["count"] == len(toks["tokens"]) and toks["max_model_len"] == 128
    assert post("/detokenize", {"tokens": toks["tokens"]}).json()["prompt"] == "for i in range(10):"
    assert _error(post("/tokenize", {}), 400)["param"] == "prompt"
