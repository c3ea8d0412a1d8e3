"""DeepSeek-V3's tool-call format: rendering tools, calls and tool results into the prompt, and
parsing calls out of the model's text (whole or as it streams).

A call as DeepSeek-V3 writes it (its chat template's format; calls are joined by a newline):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The parser reads a prefix of the text and returns only what no later text can change (text
that might be the start of a marker is held back), so parsing the text at every stream step
and sending the difference gives the same calls as parsing the whole text once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
ARGS_BEGIN = "\n```json\n"  # after the name
ARGS_END = "\n```" + CALL_END


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (what may
    still turn into the marker when more text comes)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# -- rendering (prompt side) ----------------------------------------------------------------------
def call_prefix(name: str | None = None) -> str:
    """The text that opens a call, up to its arguments when the name is given: what a forced
    tool_choice puts at the end of the prompt."""
    head = CALLS_BEGIN + CALL_BEGIN + "function" + SEP
    return head if name is None else head + name + ARGS_BEGIN


def render_calls(calls: list[tuple[str, str]]) -> str:
    """(name, arguments JSON) pairs as the assistant wrote them."""
    return CALLS_BEGIN + "\n".join(CALL_BEGIN + "function" + SEP + name + ARGS_BEGIN + args + ARGS_END
                                   for name, args in calls) + CALLS_END


def render_outputs(contents: list[str]) -> str:
    """Consecutive tool results, in the order of the calls they answer."""
    return OUTPUTS_BEGIN + "\n".join(OUTPUT_BEGIN + c + OUTPUT_END for c in contents) + OUTPUTS_END


def render_tools(tools: list[dict]) -> str:
    """The functions the model may call and how to call them, for the system prompt.
    `tools`: OpenAI's function definitions ({"name", "description", "parameters"})."""
    lines = ["## Tools", "", "You can call the functions below. To call one or more, answer with:",
             render_calls([("FUNCTION_NAME", '{"argument": "value"}')]), ""]
    for f in tools:
        lines += [f"### {f['name']}", f.get("description") or "",
                  "```json", json.dumps(f.get("parameters") or {"type": "object", "properties": {}}), "```", ""]
    return "\n".join(lines).rstrip("\n")


# -- parsing (output side) -----------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments: str
    complete: bool  # its end marker has been read


@dataclass
class ParsedText:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def parse_tool_calls(text: str, final: bool) -> ParsedText:
    """The content and calls of `text`. With final=False (the text may grow) whatever could
    still be part of a marker is left out. A call appears once its name line is complete; its
    arguments grow until its end marker. With final=True and no call found, the whole text is
    content (a model that started a call and wrote something else instead)."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return ParsedText(text if final else text[:len(text) - held_suffix(text, CALLS_BEGIN)])
    rest, pos, calls = text[start + len(CALLS_BEGIN):], 0, []
    while True:
        while pos < len(rest) and rest[pos] in " \n":
            pos += 1
        if not rest.startswith(CALL_BEGIN, pos):
            break
        sep = rest.find(SEP, pos + len(CALL_BEGIN))
        newline = rest.find("\n", sep + len(SEP)) if sep >= 0 else -1
        if newline < 0 or not rest.startswith(ARGS_BEGIN, newline):
            break  # the header is incomplete (or not in the format)
        name = rest[sep + len(SEP):newline].strip()
        args_at = newline + len(ARGS_BEGIN)
        end = rest.find(ARGS_END, args_at)
        if end < 0:
            args = rest[args_at:]
            calls.append(ParsedCall(name, args[:len(args) - held_suffix(args, ARGS_END)], False))
            break
        calls.append(ParsedCall(name, rest[args_at:end], True))
        pos = end + len(ARGS_END)
    if final and not calls:
        return ParsedText(text)
    return ParsedText(text[:start], calls)
