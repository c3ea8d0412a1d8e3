"""The DeepSeek-V3 tool-call format: what is rendered into prompts parses back, and a text
parsed prefix by prefix never takes back what it gave (so streamed deltas add up to the
non-streamed parse)."""

import json

from matrixinfer.serving.tool_parsers import (CALLS_BEGIN, call_prefix, held_suffix, parse_tool_calls, render_calls,
                                              render_outputs, render_tools)

TWO_CALLS = "Let me check." + render_calls([("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')])


def test_rendered_calls_parse_back():
    """Calls rendered as DeepSeek-V3 writes them parse to the same names and arguments, with
    the text before them as content."""
    p = parse_tool_calls(TWO_CALLS, final=True)
    assert p.content == "Let me check."
    assert [(c.name, json.loads(c.arguments), c.complete) for c in p.calls] == [
        ("get_weather", {"city": "Paris"}, True), ("get_time", {"tz": "CET"}, True)]


def test_deepseek_v3_format_literally():
    """The exact bytes of DeepSeek-V3's chat template format (calls joined by a newline)."""
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```"
            "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")
    assert render_calls([("f", '{"a": 1}'), ("g", "{}")]) == text
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, final=True).calls] == [("f", '{"a": 1}'), ("g", "{}")]


def test_text_without_calls_is_all_content():
    """No call marker: the whole text is content, and nothing is held back at the end."""
    p = parse_tool_calls("just an answer <｜tool", final=True)
    assert p.content == "just an answer <｜tool" and p.calls == []


def test_partial_marker_is_held_back_until_final():
    """While the text may still grow, a suffix that could start the call marker is not content."""
    assert parse_tool_calls("hello <｜tool▁ca", final=False).content == "hello "
    assert parse_tool_calls("hello <｜tool▁x", final=False).content == "hello <｜tool▁x"


def test_prefixes_only_ever_extend():
    """Every prefix's parse is extended by the next one: content, names and arguments; the
    last (final) parse equals the whole text's."""
    prev = parse_tool_calls("", final=False)
    for i in range(1, len(TWO_CALLS) + 1):
        cur = parse_tool_calls(TWO_CALLS[:i], final=i == len(TWO_CALLS))
        assert cur.content.startswith(prev.content)
        assert len(cur.calls) >= len(prev.calls)
        for a, b in zip(prev.calls, cur.calls):
            assert a.name == b.name and b.arguments.startswith(a.arguments)
        prev = cur
    assert prev == parse_tool_calls(TWO_CALLS, final=True)


def test_call_cut_off_keeps_its_arguments_so_far():
    """A call cut by max_tokens is returned with the arguments written (the end marker's
    start held back), and marked incomplete."""
    p = parse_tool_calls(call_prefix("f") + '{"a": 1\n``', final=True)
    assert [(c.name, c.arguments, c.complete) for c in p.calls] == [("f", '{"a": 1', False)]


def test_started_but_malformed_call_falls_back_to_content():
    """A call marker followed by text not in the format is, at the end, plain content."""
    text = "x" + CALLS_BEGIN + "nonsense"
    assert parse_tool_calls(text, final=False).content == "x"
    assert parse_tool_calls(text, final=True).content == text


def test_held_suffix():
    """The held-back length is the longest suffix that is a proper prefix of the marker."""
    assert held_suffix("ab<th", "<think>") == 3 and held_suffix("abc", "<think>") == 0
    assert held_suffix("<think>", "<think>") == 0


def test_tools_and_outputs_render():
    """The tools section names each function with its schema and shows the call format; tool
    results are wrapped in DeepSeek-V3's output markers in order."""
    tools = [{"name": "get_weather", "description": "Weather now", "parameters": {"type": "object"}}]
    text = render_tools(tools)
    assert "### get_weather" in text and "Weather now" in text and '{"type": "object"}' in text and CALLS_BEGIN in text
    assert render_outputs(["1", "2"]) == ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>1<｜tool▁output▁end｜>\n"
                                          "<｜tool▁output▁begin｜>2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
