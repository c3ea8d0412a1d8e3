"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat)."""

from __future__ import annotations

import time

from matrixinfer.frontend.outputs import CompletionOutput, RequestOutput
from matrixinfer.engine.request import Logprob
from matrixinfer.serving.chat_message import MessageParser, MessageStream
from matrixinfer.serving.reasoning import reasoning_tokens


def usage(out: RequestOutput) -> dict:
    completion = sum(len(o.token_ids) for o in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


class TokenText:
    """How a token id reads in logprobs: its text, or `token_id:N` when there is no tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ChoiceStream:
    """Deltas of one choice's cumulative outputs. Until the choice finishes, the last
    (longest stop string - 1) characters are held back: the engine cuts the text at a stop
    string only once the whole stop string has been generated."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def delta(self, out: CompletionOutput) -> tuple[str, list[Logprob] | None, str | None] | None:
        """(new text, logprobs of the new tokens, finish reason) or None if nothing to send."""
        if self.finished:
            return None
        done = out.finish_reason is not None
        end = len(out.text) if done else max(self.sent_chars, len(out.text) - self.holdback)
        text = out.text[self.sent_chars:end]
        new_lps = out.logprobs[self.sent_tokens:] if out.logprobs is not None else None
        new_tokens = len(out.token_ids) - self.sent_tokens
        if not text and not new_tokens and not done:
            return None
        self.sent_chars, self.sent_tokens, self.finished = end, len(out.token_ids), done
        return text, new_lps, out.finish_reason


class Formatter:
    """Shared by both endpoints; subclasses shape the choices."""

    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, tokenizer, num_logprobs: int | None):
        self.request_id, self.model = request_id, model
        self.created = int(time.time())
        self.token_text = TokenText(tokenizer)
        self.num_logprobs = num_logprobs  # None: no logprobs

    def response(self, out: RequestOutput) -> dict:
        choices = [self.choice(o, o.text, o.logprobs, o.finish_reason) for o in out.outputs]
        return {"id": self.request_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(out)}

    def usage(self, out: RequestOutput) -> dict:
        return usage(out)

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> dict:
        body = {"id": self.request_id, "object": self.chunk_object_name, "created": self.created,
                "model": self.model, "choices": choices}
        if with_usage:
            body["usage"] = usage_
        return body

    def stream_start(self, n: int) -> list[dict]:
        return []

    def choice(self, out: CompletionOutput, text: str, lps: list[Logprob] | None, finish: str | None,
               delta: bool = False) -> dict | None:
        """The choice's body, or (a stream delta) None when there is nothing to send."""
        raise NotImplementedError


class CompletionFormatter(Formatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, tokenizer, num_logprobs: int | None,
                 echo: list[str] | None = None, per_prompt: int = 1):
        super().__init__(request_id, model, tokenizer, num_logprobs)
        self.echo, self.per_prompt = echo, per_prompt  # echo: each prompt's text, put before its choices
        self.echoed: set[int] = set()  # streamed choices whose first delta carried the prompt

    def choice(self, out, text, lps, finish, delta=False):
        if self.echo is not None and not (delta and out.index in self.echoed):
            text = self.echo[out.index // self.per_prompt] + text
            self.echoed.add(out.index)
        return {"index": out.index, "text": text, "logprobs": self._logprobs(lps), "finish_reason": finish,
                "stop_reason": out.stop_reason if finish else None}

    def _logprobs(self, lps: list[Logprob] | None) -> dict | None:
        if self.num_logprobs is None or lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top.items()} for lp in lps],
                "text_offset": offsets}


class ChatFormatter(Formatter):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tokenizer, num_logprobs: int | None,
                 parser: MessageParser = MessageParser()):
        super().__init__(request_id, model, tokenizer, num_logprobs)
        self.tokenizer, self.parser = tokenizer, parser
        self.streams: dict[int, MessageStream] = {}  # per streamed choice

    def stream_start(self, n: int) -> list[dict]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(n)]

    def choice(self, out, text, lps, finish, delta=False):
        if self.parser.plain:
            message, calls = {"content": text} if delta else {"role": "assistant", "content": text}, False
        elif delta:
            message, calls = self.streams.setdefault(out.index, MessageStream(self.parser)).feed(text, finish is not None)
            if not message and finish is None and not lps:
                return None
        else:
            parsed = self.parser.parse(text, final=True)
            message, calls = parsed.message(), bool(parsed.calls)
        if calls and finish == "stop":
            finish = "tool_calls"
        return {"index": out.index, "delta" if delta else "message": message, "logprobs": self._logprobs(lps),
                "finish_reason": finish, "stop_reason": out.stop_reason if finish else None}

    def usage(self, out: RequestOutput) -> dict:
        body = usage(out)
        if self.parser.reasoning and self.tokenizer is not None:  # a forced call (prefill) is not thought
            body["completion_tokens_details"] = {"reasoning_tokens": 0 if self.parser.prefill else sum(
                reasoning_tokens(o.token_ids, self.tokenizer) for o in out.outputs)}
        return body

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    def _logprobs(self, lps: list[Logprob] | None) -> dict | None:
        if self.num_logprobs is None or lps is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top.items()]} for lp in lps]}
