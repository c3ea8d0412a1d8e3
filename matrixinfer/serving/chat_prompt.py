"""Chat messages (OpenAI's shape, tools included) -> the messages a chat template renders.

A template that handles tool calls itself (it mentions `tool_calls`, as DeepSeek-V3's does)
gets them as Hugging Face passes them: `tool_calls` on assistant messages, `tool_call_id` on
tool messages, `tools` beside the messages. Any other template gets plain role/content
messages with DeepSeek-V3's tool-call format written into the contents (tool_parsers.py): the
tools in the system message, an assistant's calls after its text, consecutive tool results
as one `tool` message, in the order of the calls they answer.
"""

from __future__ import annotations

from matrixinfer.serving import protocol as p
from matrixinfer.serving.tool_parsers import call_prefix, render_calls, render_outputs, render_tools


class PromptError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _text(m: p.ChatMessage) -> str:
    return m.content if isinstance(m.content, str) else "".join(part.text for part in m.content or [])


def check_tool_messages(messages: list[p.ChatMessage]) -> None:
    """Tool calls only on assistant messages; every tool message answers an earlier call."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise PromptError(f"messages.{i}: only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise PromptError(f"messages.{i}: only tool messages carry tool_call_id", f"messages.{i}.tool_call_id")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise PromptError(f"messages.{i}: a tool message needs the tool_call_id of the call it answers",
                                  f"messages.{i}.tool_call_id")
            if m.tool_call_id not in called:
                raise PromptError(f"messages.{i}: tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                                  "assistant message", f"messages.{i}.tool_call_id")
        called.update(c.id for c in m.tool_calls or [])


def template_messages(messages: list[p.ChatMessage], tools: list[p.Tool] | None, native: bool) -> list[dict]:
    """The template's messages (tools rendered in the system message unless `native`)."""
    check_tool_messages(messages)
    out: list[dict] = []
    for m in messages:
        msg = {"role": m.role, "content": _text(m), **({"name": m.name} if m.name else {})}
        if native:
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
        elif m.tool_calls:
            msg["content"] += render_calls([(c.function.name, c.function.arguments) for c in m.tool_calls])
        elif m.role == "tool":
            if out and out[-1].get("_results") is not None:  # one message for consecutive results
                out[-1]["_results"].append(msg["content"])
                continue
            msg["_results"] = [msg["content"]]
        out.append(msg)
    for msg in out:
        results = msg.pop("_results", None)
        if results is not None:
            msg["content"] = render_outputs(results)
    if tools and not native:
        section = render_tools([t.function.model_dump() for t in tools])
        if out and out[0]["role"] in ("system", "developer"):  # /tokenize may send no messages
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def forced_call(tool_choice, tools: list[p.Tool] | None) -> str:
    """What the prompt ends with to force a call (named, or `required` with one tool), or
    `required` with several: the call's opening without the name. "" otherwise."""
    names = [t.function.name for t in tools or []]
    if isinstance(tool_choice, p.NamedToolChoice):
        if tool_choice.function.name not in names:
            raise PromptError(f"tool_choice names {tool_choice.function.name!r}, which is not in tools", "tool_choice")
        return call_prefix(tool_choice.function.name)
    if tool_choice == "required":
        if not names:
            raise PromptError("tool_choice 'required' needs tools", "tool_choice")
        return call_prefix(names[0] if len(names) == 1 else None)
    return ""


def check_tools(tools: list[p.Tool] | None) -> None:
    names = [t.function.name for t in tools or []]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise PromptError(f"tools: function {dup!r} is defined twice", "tools")
