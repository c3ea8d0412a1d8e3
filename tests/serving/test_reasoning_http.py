"""`--reasoning-parser deepseek-r1` through the real server and the official `openai` client.
The bundled model never writes </think>, so by the parser's rule its whole answer is
reasoning: the test checks the text moves to reasoning_content unchanged (against a server
without the parser), streamed or not, and is counted as reasoning tokens.
(tests/serving/test_reasoning.py checks the split itself on text with both tags.)"""

import openai
import pytest

from matrixinfer.serving import build_app
from tests.serving.conftest import LiveServer

KW = dict(model="tiny-moe", messages=[{"role": "user", "content": "think about it"}], max_tokens=10, temperature=0,
          extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def clients(bundled_engine):
    servers = [LiveServer(build_app(bundled_engine, reasoning_parser=r)) for r in (None, "deepseek-r1")]
    yield [openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60) for s in servers]
    for s in servers:
        s.stop()


def test_unclosed_thinking_is_reasoning_content(clients):
    """The same greedy answer is `content` without the parser and `reasoning_content` with it;
    usage counts every completion token as a reasoning token."""
    plain, thinking = clients
    text = plain.chat.completions.create(**KW).choices[0].message.content
    r = thinking.chat.completions.create(**KW)
    msg = r.choices[0].message
    assert msg.reasoning_content == text and msg.content is None
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 10
    assert plain.chat.completions.create(**KW).usage.completion_tokens_details is None


def test_streamed_reasoning_adds_up(clients):
    """Streamed `delta.reasoning_content` pieces add up to the non-streamed reasoning; the
    final usage chunk has the reasoning token count."""
    _, thinking = clients
    full = thinking.chat.completions.create(**KW).choices[0].message.reasoning_content
    chunks = list(thinking.chat.completions.create(stream=True, stream_options={"include_usage": True}, **KW))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == full
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10


def test_forced_tool_call_is_not_read_as_reasoning(clients):
    """A named tool_choice opens the call in the prompt: the model's text is the call's
    arguments, not reasoning."""
    _, thinking = clients
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = thinking.chat.completions.create(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}},
                                         **KW)
    assert r.choices[0].message.tool_calls[0].function.name == "f"
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_unknown_reasoning_parser_is_refused(bundled_engine):
    """A parser name the server does not know fails at start-up, not per request."""
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(bundled_engine, reasoning_parser="qwen3")
