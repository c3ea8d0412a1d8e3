"""One chat choice's text -> the assistant message's parts: `reasoning_content` (with a
reasoning parser), `content` and `tool_calls` (when the request has tools), whole or as
stream deltas. Reasoning is split off first; tool calls are parsed from what follows it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from matrixinfer.serving.reasoning import split_reasoning
from matrixinfer.serving.tool_parsers import ParsedCall, parse_tool_calls


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class MessageParser:
    """How a request's outputs are read. `prefill`: text the prompt already ends with (a
    forced tool call's opening), read as if the model had written it; the model then writes
    no reasoning, so none is split off."""
    reasoning: bool = False
    tools: bool = False
    parallel_tool_calls: bool = True
    prefill: str = ""

    @property
    def plain(self) -> bool:
        return not (self.reasoning or self.tools)

    def parse(self, text: str, final: bool) -> "ParsedMessage":
        reasoning, rest = None, text
        if self.reasoning and not self.prefill:
            split = split_reasoning(text, final)
            reasoning, rest = split.reasoning, split.content
        if not self.tools or rest is None:
            return ParsedMessage(reasoning, rest)
        parsed = parse_tool_calls(self.prefill + rest, final)
        calls = parsed.calls if self.parallel_tool_calls else parsed.calls[:1]
        return ParsedMessage(reasoning, parsed.content, calls)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)

    def message(self) -> dict:
        """The non-streamed `message` (content is null when it is empty beside tool calls)."""
        msg = {"role": "assistant", "content": None if self.calls and not self.content else self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [{"id": tool_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return msg


class MessageStream:
    """A choice's stream deltas: the message parsed from all text so far, minus what was sent.
    (Re-parsing the whole text each step costs O(length) string scans; cheap beside a step.)"""

    def __init__(self, parser: MessageParser):
        self.parser, self.text = parser, ""
        self.sent_reasoning = self.sent_content = 0
        self.sent_args: list[int] = []  # per call sent: characters of its arguments

    def feed(self, text: str, final: bool) -> tuple[dict, bool]:
        """(delta fields for the new `text`, whether the message has tool calls so far)."""
        self.text += text
        m = self.parser.parse(self.text, final)
        delta: dict = {}
        if m.reasoning is not None and len(m.reasoning) > self.sent_reasoning:
            delta["reasoning_content"] = m.reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(m.reasoning)
        if m.content is not None and len(m.content) > self.sent_content:
            delta["content"] = m.content[self.sent_content:]
            self.sent_content = len(m.content)
        calls = []
        for i, c in enumerate(m.calls):
            if i == len(self.sent_args):  # a new call: its header first
                calls.append({"index": i, "id": tool_call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
                self.sent_args.append(len(c.arguments))
            elif len(c.arguments) > self.sent_args[i]:
                calls.append({"index": i, "function": {"arguments": c.arguments[self.sent_args[i]:]}})
                self.sent_args[i] = len(c.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta, bool(m.calls)
