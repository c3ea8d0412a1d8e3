"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`): one assistant message
per response, in OpenAI's response object and stream events.

A turn is a chat prompt: `instructions` (this turn's system message), the conversation of
`previous_response_id` and this turn's input, through the chat template. A stored response
keeps the exact token ids of its prompt and answer, and the next turn's prompt is those ids
followed by what the template adds for the new messages: the tokens the model saw and wrote
are not re-tokenized (merges at the seams could differ) nor re-rendered (a template may
render a past answer differently from the turn that produced it, as the bundled model's
drops the `# assistant:` header), so the whole previous turn is a prefix-cache hit and
`cached_tokens` shows it. When the instructions change, or the template's rendering of the
new turn does not extend the old, the conversation is rendered afresh. Responses are kept in
memory per server (LRU), visible to their tenant only.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from matrixinfer.frontend.outputs import RequestOutput
from matrixinfer.serving import protocol as p
from matrixinfer.serving.errors import APIError
from matrixinfer.serving.openai_format import ChoiceStream, usage
from matrixinfer.serving.tenants import Tenant

if TYPE_CHECKING:
    from matrixinfer.serving.api_server import TokenService

MAX_STORED = 1024  # responses kept per server


@dataclass
class StoredResponse:
    tenant: str
    instructions: str | None
    messages: list[p.ChatMessage]  # the conversation with this turn's answer, without instructions
    answer: str  # the answer's text
    token_ids: list[int]  # the prompt's and the answer's token ids
    ended_with_eos: bool  # the answer's last token is end-of-sequence
    body: dict  # the response object


class ResponseStore:
    """The last MAX_STORED responses, by id."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity, self._items = capacity, OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        self._items[rid] = item
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, tenant: str, param: str = "previous_response_id") -> StoredResponse:
        item = self._items.get(rid)
        if item is None or item.tenant != tenant:  # another tenant's id is as unknown as a made-up one
            raise APIError(404, f"Response with id '{rid}' not found (responses are kept in memory, the last "
                                f"{self.capacity}, and only with store=true).", param=param, code="not_found",
                           type="invalid_request_error")
        self._items.move_to_end(rid)
        return item


def check_request(body: p.ResponsesRequest) -> None:
    """Fields accepted by the schema but not served: refused by name."""
    if body.tools:
        raise APIError(400, "tools on /v1/responses are not supported yet: use /v1/chat/completions",
                       param="tools", code="unsupported_parameter")
    if isinstance(body.input, list) and not body.input:
        raise APIError(400, "input is an empty list", param="input")


def _format(body: p.ResponsesRequest) -> p.ResponseFormat | None:
    """`text.format` in chat's `response_format` shape (the same structured outputs)."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    return p.ResponseFormat(type=fmt.type, json_schema={"name": fmt.name, "schema": fmt.schema_}
                            if fmt.type == "json_schema" else None)


def _system(instructions: str | None) -> list[p.ChatMessage]:
    return [p.ChatMessage(role="system", content=instructions)] if instructions else []


def input_messages(body: p.ResponsesRequest) -> list[p.ChatMessage]:
    if isinstance(body.input, str):
        return [p.ChatMessage(role="user", content=body.input)]
    return [p.ChatMessage(role=m.role, content=m.content if isinstance(m.content, str)
                          else "".join(part.text for part in m.content)) for m in body.input]


def continued_prompt(prev: StoredResponse, history: str, full: str, eos: str | None, encode) -> list[int] | None:
    """`prev`'s token ids, then what this turn's rendering `full` adds to `history` (prev's
    conversation with its answer, rendered without a generation prompt), after the text the
    template puts behind an answer (its end-of-sequence unless the model wrote it). None when
    `full` does not extend `history`."""
    at = history.rfind(prev.answer) if prev.answer else -1
    if at < 0 or not full.startswith(history):
        return None
    glue = history[at + len(prev.answer):]
    if prev.ended_with_eos and eos and glue.startswith(eos):
        glue = glue[len(eos):]
    return prev.token_ids + encode(glue + full[len(history):])


def _usage(out: RequestOutput) -> dict:
    u = usage(out)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class ResponseFormatter:
    """One response's object and stream events."""

    def __init__(self, body: p.ResponsesRequest, model: str, params_max_tokens: int):
        self.req, self.model = body, model
        self.id, self.msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.max_output_tokens = body.max_output_tokens or params_max_tokens
        self.seq = 0

    def message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "empty" else []
        return {"id": self.msg_id, "type": "message", "status": "in_progress" if status == "empty" else status,
                "role": "assistant", "content": content}

    def response(self, out: RequestOutput | None) -> dict:
        """The response object: in progress (out None) or finished."""
        cut = out is not None and out.outputs[0].finish_reason == "length"
        status = "in_progress" if out is None else "incomplete" if cut else "completed"
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": self.model,
            "output": [] if out is None else [self.message(out.outputs[0].text, "incomplete" if cut else "completed")],
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "store": r.store, "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "text": {"format": r.text.format.model_dump(by_alias=True, exclude_none=True)
                     if r.text and r.text.format else {"type": "text"}},
            "tool_choice": r.tool_choice or "auto", "tools": [], "truncation": "disabled",
            "usage": None if out is None else _usage(out), "user": r.user, "metadata": r.metadata or {},
        }

    def event(self, type: str, **fields) -> str:
        body = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(body)}\n\n"

    async def events(self, stream, meter, on_done):
        """The stream's events; `meter` holds the first output; `on_done(last output)` when it
        finished (not when the client left)."""
        at = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        choice, text = ChoiceStream(0), ""
        try:
            yield self.event("response.created", response=self.response(None))
            yield self.event("response.in_progress", response=self.response(None))
            yield self.event("response.output_item.added", output_index=0, item=self.message("", "empty"))
            yield self.event("response.content_part.added", part=part, **at)
            while True:
                d = choice.delta(meter.last.outputs[0])
                if d is not None and d[0]:
                    text += d[0]
                    yield self.event("response.output_text.delta", delta=d[0], logprobs=[], **at)
                if meter.last.finished:
                    break
                meter.last = await anext(stream)
            final = self.response(meter.last)
            yield self.event("response.output_text.done", text=text, logprobs=[], **at)
            yield self.event("response.content_part.done", part={**part, "text": text}, **at)
            yield self.event("response.output_item.done", output_index=0, item=final["output"][0])
            meter.close()
            on_done(meter.last, final)
            yield self.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                             response=final)
        except Exception as e:  # the engine failed mid-stream: say so, then end the stream
            yield self.event("error", code="server_error", message=f"generation failed: {e}", param=None)
        finally:
            await stream.aclose()
            meter.close()


async def create_response(service: "TokenService", raw: Request, tenant: Tenant, body: p.ResponsesRequest) -> Response:
    """POST /v1/responses: render the turn, generate, answer (JSON or events), store it."""
    service.check_model(body.model)
    check_request(body)
    store, tok = service.responses, service.engine.tokenizer
    prev = store.get(body.previous_response_id, tenant.name) if body.previous_response_id else None
    conversation = (prev.messages if prev else []) + input_messages(body)
    full = service.chat_text(_system(body.instructions) + conversation)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731 (the template placed bos)
    ids = None
    if prev is not None and prev.instructions == body.instructions:
        history = service.chat_text(_system(prev.instructions) + prev.messages, add_generation_prompt=False)
        ids = continued_prompt(prev, history, full, tok.eos_token, encode)
    ids = ids if ids is not None else encode(full)
    sampling = p._SamplingRequest(temperature=body.temperature, top_p=body.top_p, response_format=_format(body))
    try:
        params = service.sampling_params(sampling, len(ids), body.max_output_tokens, None, "input")
    except APIError as e:  # name this API's field
        if e.param and e.param.startswith("response_format"):
            e.param = "text.format"
        raise
    fmt = ResponseFormatter(body, service.engine.model_name, params.max_tokens)

    def done(out: RequestOutput, final: dict) -> None:
        if body.store:
            a = out.outputs[0]
            messages = conversation + [p.ChatMessage(role="assistant", content=a.text)]
            eos = bool(a.token_ids) and a.token_ids[-1] == tok.eos_token_id
            store.put(fmt.id, StoredResponse(tenant.name, body.instructions, messages, a.text, ids + a.token_ids, eos,
                                             final))

    stream, meter = await service.start(tenant, body.user, fmt.id, [ids], params, "input")
    if body.stream:
        return StreamingResponse(fmt.events(stream, meter, done), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    await service.collect(raw, stream, meter)
    final = fmt.response(meter.last)
    if meter.last.finished:
        done(meter.last, final)
    return JSONResponse(final)
