"""Reasoning parsers (`serve --reasoning-parser`): a thinking model's text split into its
reasoning and its answer.

deepseek-r1: reasoning is the text before `</think>` (an opening `<think>` is dropped: R1's
chat template often puts it in the prompt, so the output may or may not start with it); the
answer is the text after. A text with no `</think>` is all reasoning (the model was cut off
while thinking), as vLLM's parser of the same name does. Like the tool parser, the split of a
prefix of the text never takes back what it gave: text that may become a tag is held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from matrixinfer.serving.tool_parsers import held_suffix

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek-r1",)


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str | None  # None while (or if) the model is still thinking


def split_reasoning(text: str, final: bool) -> ReasoningSplit:
    """`text` (the whole output so far) as reasoning and content."""
    body = text
    if body.startswith(THINK_START):
        body = body[len(THINK_START):]
    elif not final and THINK_START.startswith(body):
        return ReasoningSplit("", None)  # may still become <think>
    end = body.find(THINK_END)
    if end >= 0:
        return ReasoningSplit(body[:end], body[end + len(THINK_END):])
    return ReasoningSplit(body if final else body[:len(body) - held_suffix(body, THINK_END)], None)


def reasoning_tokens(token_ids: list[int], tokenizer) -> int:
    """How many of `token_ids` are reasoning: those up to the one completing `</think>` (all of
    them when the model never closed its thinking)."""
    stream, tail = tokenizer.decode_stream(skip_special_tokens=True), ""
    for i, t in enumerate(token_ids):
        tail = tail[-len(THINK_END):] + (stream.step(t) or "")  # enough to see the tag end in the new text
        if THINK_END in tail:
            return i + 1
    return len(token_ids)
