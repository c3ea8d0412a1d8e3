"""A chat choice's text -> message parts: streamed deltas fed a token-sized piece at a time
add up to the non-streamed message (reasoning, content, tool calls with their arguments)."""

import json

from matrixinfer.serving.chat_message import MessageParser, MessageStream
from matrixinfer.serving.tool_parsers import call_prefix, render_calls


def _stream(parser, text, step=3):
    s, deltas = MessageStream(parser), []
    for i in range(0, len(text), step):
        delta, _ = s.feed(text[i:i + step], final=i + step >= len(text))
        deltas.append(delta)
    return deltas


def _joined(deltas):
    out = {"reasoning_content": "", "content": "", "calls": {}}
    for d in deltas:
        out["reasoning_content"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = out["calls"].setdefault(c["index"], {"name": None, "arguments": "", "ids": []})
            if "id" in c:
                call["ids"].append(c["id"])
                call["name"] = c["function"]["name"]
            call["arguments"] += c["function"]["arguments"]
    return out


TEXT = "<think>plan</think>Sure." + render_calls([("f", '{"x": [1, 2]}'), ("g", '{"y": "z"}')])


def test_stream_adds_up_to_the_message():
    """Reasoning, content and both calls: the deltas' concatenation equals the message; each
    call's header (id, name) comes once."""
    parser = MessageParser(reasoning=True, tools=True)
    msg = parser.parse(TEXT, final=True).message()
    assert msg["reasoning_content"] == "plan" and msg["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("f", {"x": [1, 2]}), ("g", {"y": "z"})]
    for step in (1, 3, 7, len(TEXT)):
        j = _joined(_stream(parser, TEXT, step))
        assert j["reasoning_content"] == "plan" and j["content"] == "Sure."
        assert [(c["name"], c["arguments"], len(c["ids"])) for c in j["calls"].values()] == [
            ("f", '{"x": [1, 2]}', 1), ("g", '{"y": "z"}', 1)]


def test_parallel_tool_calls_false_keeps_the_first_call():
    """parallel_tool_calls=false: only the first call is returned, streamed or not."""
    parser = MessageParser(reasoning=True, tools=True, parallel_tool_calls=False)
    assert [c["function"]["name"] for c in parser.parse(TEXT, final=True).message()["tool_calls"]] == ["f"]
    assert list(_joined(_stream(parser, TEXT))["calls"]) == [0]


def test_prefill_is_read_as_the_calls_opening():
    """A forced call's opening is in the prompt: the model's text is its arguments."""
    parser = MessageParser(tools=True, prefill=call_prefix("f"))
    msg = parser.parse('{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', final=True).message()
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    j = _joined(_stream(parser, '{"a": 1}'))
    assert j["calls"][0]["name"] == "f" and j["calls"][0]["arguments"] == '{"a": 1}'


def test_no_tools_no_reasoning_is_plain_text():
    """Without tools the call markers are just text."""
    msg = MessageParser(reasoning=True).parse(TEXT, final=True).message()
    assert "tool_calls" not in msg and msg["content"].startswith("Sure.<｜tool▁calls▁begin｜>")


def test_formatter_reports_tool_calls_as_the_finish_reason():
    """A choice that ended (stop) with calls finishes with "tool_calls", streamed or not; one
    cut by max_tokens stays "length"."""
    from matrixinfer.frontend.outputs import CompletionOutput, RequestOutput
    from matrixinfer.serving.openai_format import ChatFormatter

    text = "ok" + render_calls([("f", "{}")])
    fmt = ChatFormatter("id", "m", None, None, MessageParser(tools=True))
    for reason, expect in (("stop", "tool_calls"), ("length", "length")):
        out = RequestOutput("id", None, [1], [CompletionOutput(0, text, [2, 3], finish_reason=reason)], True)
        choice = fmt.response(out)["choices"][0]
        assert choice["finish_reason"] == expect and choice["message"]["tool_calls"][0]["function"]["name"] == "f"
    stream = ChatFormatter("id", "m", None, None, MessageParser(tools=True))
    out = CompletionOutput(0, text, [2, 3], finish_reason="stop")
    assert stream.choice(out, text[:4], None, None, delta=True)["delta"] == {"content": "ok"}
    assert stream.choice(out, text[4:], None, "stop", delta=True)["finish_reason"] == "tool_calls"
