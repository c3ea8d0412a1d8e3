"""Tool calls through the real bundled_server with the official `openai` bundled_client, on the bundled model
(which has never seen a tool call: the tests check what the bundled_server renders and how it reads
and shapes the output; tests/serving/test_tool_parsers.py checks the parsing itself)."""

import json

import httpx
import pytest


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "weather in Paris?"}]
GREEDY = dict(model="tiny-moe", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})


def _tokens(bundled_server, **body):
    r = httpx.post(bundled_server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _error(bundled_server, body):
    r = httpx.post(bundled_server.url + "/v1/chat/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_tools_are_rendered_into_the_prompt(bundled_client, bundled_server, bundled_engine):
    """With tools the prompt holds their DeepSeek-V3 description (what /tokenize shows), and
    with tool_choice "none" it does not."""
    with_tools = _tokens(bundled_server, messages=USER, tools=[WEATHER])
    plain = _tokens(bundled_server, messages=USER)
    text = bundled_engine.tokenizer.decode(with_tools, skip_special_tokens=False)
    assert "### get_weather" in text and "<｜tool▁calls▁begin｜>" in text and len(with_tools) > len(plain)
    r = bundled_client.chat.completions.create(messages=USER, tools=[WEATHER], **GREEDY)
    assert r.usage.prompt_tokens == len(with_tools)
    r = bundled_client.chat.completions.create(messages=USER, tools=[WEATHER], tool_choice="none", **GREEDY)
    assert r.usage.prompt_tokens == len(plain) and r.choices[0].message.tool_calls is None


def test_history_with_calls_and_results_is_rendered(bundled_client, bundled_server, bundled_engine):
    """An assistant turn with tool_calls and the tool results answering it are accepted and
    rendered in DeepSeek-V3's format, results in the order of the calls."""
    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    text = bundled_engine.tokenizer.decode(_tokens(bundled_server, messages=msgs, tools=[WEATHER, TIME]),
                                           skip_special_tokens=False)
    assert 'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>' in text
    # the two results are one tool turn (the bundled template prefixes its lines with "# ")
    assert text.count("<｜tool▁outputs▁begin｜>") == 1 and text.index("sunny") < text.index("noon")
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in text
    r = bundled_client.chat.completions.create(messages=msgs, tools=[WEATHER, TIME], **GREEDY)
    assert r.choices[0].message.role == "assistant"


def test_named_tool_choice_returns_that_call(bundled_client):
    """A named tool_choice always answers with a call of that function; its arguments are what
    the model wrote (the tiny model writes no JSON), the same streamed as not."""
    kw = dict(messages=USER, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
              **GREEDY)
    r = bundled_client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content is None and [c.function.name for c in msg.tool_calls] == ["get_time"]
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    assert r.choices[0].finish_reason in ("length", "tool_calls")
    chunks = list(bundled_client.chat.completions.create(stream=True, **kw))
    calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_time"
    assert {c.index for c in calls} == {0} and sum(1 for c in calls if c.id) == 1
    assert "".join(c.function.arguments or "" for c in calls) == msg.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_required_with_one_tool_calls_it(bundled_client):
    """tool_choice "required" with a single tool forces a call of it."""
    r = bundled_client.chat.completions.create(messages=USER, tools=[WEATHER], tool_choice="required", **GREEDY)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_auto_without_a_call_is_plain_content(bundled_client):
    """tool_choice auto and an answer without the call format: content, no tool_calls."""
    r = bundled_client.chat.completions.create(messages=USER, tools=[WEATHER], **GREEDY)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": USER + [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(bundled_server, body, param):
    """Each malformed tools request is a 400 whose param points at the fault."""
    err = _error(bundled_server, body)
    assert err["param"] == param, err


def test_tokenize_with_tools_and_no_messages_is_not_a_500(bundled_server):
    """/tokenize with tools and an empty messages list (found by the fuzzer): answered, not a
    server error."""
    r = httpx.post(bundled_server.url + "/tokenize", json={"messages": [], "tools": [WEATHER]}, timeout=30)
    assert r.status_code < 500, r.text
