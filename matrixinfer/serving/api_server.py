"""The OpenAI-compatible HTTP API: a FastAPI app over any EngineClient.

One request's path: authenticate the key -> tenant; validate and tokenize; admit against the
tenant's quotas and rate limits; `engine.generate` with the tenant as cache namespace; answer
(JSON or server-sent events); meter the tokens into the ledger and the metrics, also when
the client went away (its request is aborted and its cache blocks freed).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.serving import protocol as p
from matrixinfer.serving.async_engine import EngineClient, GenerateRequest
from matrixinfer.serving.ledger import UsageLedger
from matrixinfer.serving.batching import best_of, merged
from matrixinfer.serving.chat_message import MessageParser
from matrixinfer.serving.chat_prompt import PromptError, check_tools, forced_call, template_messages
from matrixinfer.serving.drain import Drain, DrainMiddleware
from matrixinfer.serving.errors import APIError, error_response
from matrixinfer.serving.limits import LimitExceeded, Limiter, Reservation
from matrixinfer.serving.metrics import ServingMetrics
from matrixinfer.serving.openai_format import ChatFormatter, ChoiceStream, CompletionFormatter, Formatter, usage
from matrixinfer.serving.reasoning import REASONING_PARSERS
from matrixinfer.serving.responses import ResponseStore, create_response
from matrixinfer.serving.structured import request_structure, tool_call_structure
from matrixinfer.serving.tenants import ANONYMOUS, Tenant, TenantStore

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 64  # prompts in one batched completions request


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    # a union reports an error per member: the deepest one is where the value went wrong
    # (input: [{"role": "robot"}] fails as a string and, at input.0.role, as a list of messages)
    err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # pydantic reports union members as extra loc parts (prompt.str, tool_choice.NamedToolChoice,
    # input.list[InputMessage]); keep the field path
    loc = [x for x in loc if x not in ("str", "int", "float", "bool") and "[" not in x
           and not x.startswith("function-") and not x[:1].isupper()]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif err.get("type") == "json_invalid":
        message, param = f"The request body is not valid JSON: {err.get('msg')}", None
    else:
        message = f"{param or 'body'}: {err.get('msg')}"
    return error_response(400, message, param=param, code="invalid_value" if param else None)


_ERRORS = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 429)}
_GENERATE_RESPONSES = {**_ERRORS, 200: {"content": {"text/event-stream": {"schema": p.SSE_EVENT_SCHEMA}}}}


class TokenService:
    """The state behind the routes: the engine, tenants, ledger, limiter and metrics."""

    def __init__(self, engine: EngineClient, tenants: TenantStore | None = None, ledger: UsageLedger | None = None,
                 reasoning_parser: str | None = None):
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(REASONING_PARSERS)}")
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.responses = ResponseStore()  # for the Responses API's previous_response_id
        self.tenants = tenants
        self.ledger = ledger
        self.limiter = Limiter(ledger)
        self.metrics = ServingMetrics(engine)

    # -- tenants --------------------------------------------------------------------------------
    def authenticate(self, creds: HTTPAuthorizationCredentials | None) -> Tenant:
        if self.tenants is None or not self.tenants.has_keys():
            return Tenant(ANONYMOUS)
        if creds is None or not creds.credentials:
            self.metrics.rejected("unauthenticated")
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                                "(make one with `matrixinfer keys add --tenant NAME`).", code="missing_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        tenant = self.tenants.authenticate(creds.credentials)
        if tenant is None:
            self.metrics.rejected("unauthenticated")
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return tenant

    # -- request -> engine request --------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.engine.model_name}`.", param="model", code="model_not_found")

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
            ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            vocab = self.engine.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        return ids

    def completion_prompts(self, prompt) -> list[list[int]]:
        """`prompt` as text, token ids, or a batch of either -> token ids per prompt."""
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [self.tokenize_prompt(prompt)]
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
        return [self.tokenize_prompt(x, param=f"prompt.{i}") for i, x in enumerate(prompt)]

    def chat_prompt(self, messages: list[p.ChatMessage], tools: list[p.Tool] | None = None,
                    prefill: str = "") -> list[int]:
        """Token ids of the templated conversation (and `tools`), ending with the assistant's
        turn opened and `prefill` (a forced tool call's opening)."""
        # the template already placed bos where it belongs: do not add another
        return self.tokenize_prompt(self.chat_text(messages, tools) + prefill, param="messages",
                                    add_special_tokens=False)

    def chat_text(self, messages: list[p.ChatMessage], tools: list[p.Tool] | None = None,
                  add_generation_prompt: bool = True) -> str:
        tok = self.engine.tokenizer
        if tok is None or not tok.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        native = "tool_calls" in tok.chat_template  # the template renders tool calls itself
        try:
            check_tools(tools)
            msgs = template_messages(messages, tools, native)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param) from e
        try:
            return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                           tools=[t.model_dump() for t in tools] if tools and native else None)
        except Exception as e:  # the template's own raise_exception(), or a bad template
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e

    def message_parser(self, body: p.ChatCompletionRequest) -> tuple[MessageParser, list[p.Tool] | None]:
        """How the request's output is read, and the tools its prompt shows (none with
        tool_choice "none": the model is not offered them)."""
        tools = body.tools if body.tool_choice != "none" else None
        try:
            prefill = forced_call(body.tool_choice, body.tools)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param) from e
        return MessageParser(reasoning=self.reasoning_parser is not None, tools=bool(tools),
                             parallel_tool_calls=body.parallel_tool_calls is not False, prefill=prefill), tools

    def sampling_params(self, body: p._SamplingRequest, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, prompt_param: str) -> SamplingParams:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, and your prompt has "
                                f"{prompt_len} tokens (at least one must be left for the completion). "
                                "Please shorten the prompt.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                                "completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise APIError(400, f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        structure = request_structure(body)
        try:
            return SamplingParams(
                n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or -1,
                min_p=body.min_p or 0.0, seed=body.seed, max_tokens=max_tokens, stop=stop or None,
                ignore_eos=body.ignore_eos, logprobs=logprobs, min_tokens=body.min_tokens,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=self._token_map(body.logit_bias), stop_token_ids=self._token_ids(body.stop_token_ids),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens, structured_outputs=structure,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def _token_map(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """logit_bias: OpenAI's keys are token ids written as strings."""
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            tid = int(key) if key.lstrip("-").isdigit() else None
            if tid is None or not 0 <= tid < self.engine.vocab_size:
                raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {self.engine.vocab_size})",
                               param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias value {value} for token {key} is outside [-100, 100]",
                               param="logit_bias")
            out[tid] = value
        return out

    def _token_ids(self, ids: list[int] | None) -> list[int] | None:
        bad = next((t for t in ids or [] if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop token id {bad} is outside the vocabulary [0, {self.engine.vocab_size})",
                           param="stop_token_ids")
        return ids

    # -- generation -----------------------------------------------------------------------------
    async def start(self, tenant: Tenant, user: str | None, request_id: str, prompts: list[list[int]],
                    params: SamplingParams, prompt_param: str):
        """Admit `prompts` (one engine request each, `params.n` choices each) against the
        tenant's limits and start them: (the merged output stream, its meter holding the first
        output). Refusals (limits, the engine's own checks) are APIErrors."""
        try:
            reservation = self.limiter.admit(tenant, sum(map(len, prompts)), len(prompts) * params.n * params.max_tokens)
        except LimitExceeded as e:
            self.metrics.rejected(e.code)
            raise APIError(429, str(e), code=e.code, type="rate_limit_error" if e.code != "insufficient_quota"
                           else "insufficient_quota", headers={"Retry-After": str(e.retry_after)}) from e
        arrival = time.monotonic()
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [self.engine.generate(GenerateRequest(rid, prompt, params, namespace=tenant.name, arrival_time=arrival))
                   for rid, prompt in zip(ids, prompts)]
        stream = streams[0] if len(streams) == 1 else merged(request_id, streams)
        try:
            first = await anext(stream)
        except ValueError as e:  # the engine's own checks refused the request
            await stream.aclose()
            self.limiter.finish(tenant, 0, 0, reservation)
            raise APIError(400, str(e), param=prompt_param) from e
        except Exception as e:
            await stream.aclose()
            self.limiter.finish(tenant, 0, 0, reservation)
            raise APIError(500, f"generation failed: {e}", type="server_error") from e
        return stream, _Meter(self, tenant, user, arrival, first, reservation)

    @staticmethod
    async def collect(raw: Request, stream, meter: "_Meter") -> None:
        """Read `stream` to its last output (or until the client leaves: the request is
        aborted), then meter it."""
        async with aclosing(stream):
            try:
                while not meter.last.finished:
                    if await raw.is_disconnected():
                        break
                    meter.last = await anext(stream)
            except Exception as e:
                meter.close()
                raise APIError(500, f"generation failed: {e}", type="server_error") from e
        meter.close()

    async def generate(self, raw: Request, tenant: Tenant, body: p._SamplingRequest, prompts: list[list[int]],
                       params: SamplingParams, fmt: Formatter, prompt_param: str, keep: int | None = None) -> Response:
        """Run `prompts` as one API request, answered as `fmt` shapes it.
        `keep`: return only this many choices per prompt, those of highest cumulative logprob
        (best_of; every generated token is still metered)."""
        stream, meter = await self.start(tenant, body.user, fmt.request_id, prompts, params, prompt_param)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._events(stream, meter, fmt, params, len(prompts) * params.n, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await self.collect(raw, stream, meter)
        if keep is None:
            return JSONResponse(fmt.response(meter.last))
        body = fmt.response(best_of(meter.last, params.n, keep))
        body["usage"] = usage(meter.last)  # what was metered: every generated choice
        return JSONResponse(body)

    async def _events(self, stream, meter: "_Meter", fmt: Formatter, params: SamplingParams, n_choices: int,
                      include_usage: bool):
        holdback = 0 if params.include_stop_str_in_output else max((len(s) for s in params.stop_list), default=1) - 1
        choices = [ChoiceStream(holdback) for _ in range(n_choices)]
        try:
            async with aclosing(stream):
                for chunk in fmt.stream_start(n_choices):
                    yield _sse(chunk, include_usage)
                while True:
                    for out, cs in zip(meter.last.outputs, choices):
                        d = cs.delta(out)
                        if d is not None and (d[0] or d[2] or fmt.num_logprobs is not None):
                            c = fmt.choice(out, *d, delta=True)
                            if c is not None:  # None: the parsers hold all of the new text back
                                yield _sse(fmt.chunk([c]), include_usage)
                    if meter.last.finished:
                        break
                    meter.last = await anext(stream)
            if include_usage:
                yield f"data: {json.dumps(fmt.chunk([], fmt.usage(meter.last), with_usage=True))}\n\n"
        except Exception as e:  # the engine failed mid-stream: say so in the stream, then end it
            err = {"error": {"message": f"generation failed: {e}", "type": "server_error", "param": None,
                             "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            meter.close()
        yield "data: [DONE]\n\n"


def _sse(chunk: dict, include_usage: bool) -> str:
    if include_usage:
        chunk.setdefault("usage", None)
    return f"data: {json.dumps(chunk)}\n\n"


class _Meter:
    """Meters one request once, when it ends for any reason: ledger, limiter, metrics."""

    def __init__(self, service: TokenService, tenant: Tenant, end_user: str | None, arrival: float, first,
                 reservation: Reservation):
        self.service, self.tenant, self.end_user, self.arrival = service, tenant, end_user, arrival
        self.last = first
        self.reservation = reservation
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        s, out = self.service, self.last
        u = usage(out)
        if s.ledger is not None:
            s.ledger.record(self.tenant.name, s.engine.model_name, out.request_id, u["prompt_tokens"],
                            u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"],
                            end_user=self.end_user, finish=",".join(o.finish_reason or "abort" for o in out.outputs))
        s.limiter.finish(self.tenant, u["prompt_tokens"], u["completion_tokens"], self.reservation)
        first = out.metrics.get("first_token_time")
        s.metrics.observe(self.tenant.name, u["prompt_tokens"], u["completion_tokens"],
                          None if first is None else first - self.arrival, time.monotonic() - self.arrival,
                          max((len(o.token_ids) for o in out.outputs), default=0),
                          [o.finish_reason for o in out.outputs], u["prompt_tokens_details"]["cached_tokens"])


def build_app(engine: EngineClient, tenants: TenantStore | None = None, ledger: UsageLedger | None = None,
              own_engine: bool = False, reasoning_parser: str | None = None) -> FastAPI:
    """The HTTP app over `engine`. Without a tenant store (or with one holding no keys) every
    request is served as the anonymous tenant. With `own_engine` the app's lifespan shuts the
    engine down when the server stops (what `matrixinfer serve` does). `app.state.drain` is
    the graceful-shutdown switch (drain.py). `reasoning_parser` (reasoning.py) splits chat
    answers into reasoning_content and content."""
    service = TokenService(engine, tenants, ledger, reasoning_parser)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        if own_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="matrixinfer token service", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat over matrixinfer, metered per tenant.")
    app.state.service = service
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    bearer = HTTPBearer(auto_error=False)

    async def tenant_of(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Tenant:
        return service.authenticate(creds)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        service.metrics.rejected("invalid_request")
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=_GENERATE_RESPONSES)
    async def completions(body: p.CompletionRequest, raw: Request, tenant: Tenant = Depends(tenant_of)):
        service.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported: the served model was not trained for fill-in-the-middle",
                           param="suffix", code="unsupported_parameter")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")
        if body.best_of is not None and body.best_of < body.n:
            raise APIError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of")
        generated = body.best_of or body.n
        if body.stream and generated > body.n:
            raise APIError(400, "best_of greater than n cannot be streamed", param="best_of")
        prompts = service.completion_prompts(body.prompt)
        longest = max(prompts, key=len)
        params = service.sampling_params(body, len(longest), body.max_tokens, body.logprobs,
                                         "prompt" if len(prompts) == 1 else f"prompt.{prompts.index(longest)}")
        if generated > body.n:  # ranking needs the cumulative logprob, which comes with logprobs
            params = replace(params, n=generated, logprobs=0 if params.logprobs is None else params.logprobs)
        echo = [engine.tokenizer.decode(ids) if engine.tokenizer else "" for ids in prompts] if body.echo else None
        fmt = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", engine.model_name, engine.tokenizer, body.logprobs,
                                  echo=echo, per_prompt=body.n)
        return await service.generate(raw, tenant, body, prompts, params, fmt, "prompt",
                                      keep=body.n if generated > body.n else None)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=_GENERATE_RESPONSES)
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request, tenant: Tenant = Depends(tenant_of)):
        service.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        parser, tools = service.message_parser(body)
        ids = service.chat_prompt(body.messages, tools, parser.prefill)
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = service.sampling_params(body, len(ids), body.max_completion_tokens or body.max_tokens,
                                         num_logprobs, "messages")
        if parser.prefill:  # a forced call: its arguments follow the function's schema
            if params.structured_outputs is not None:
                raise APIError(400, "a forced tool call (tool_choice required or named) takes no other structured "
                                    "output", param="tool_choice")
            params = replace(params, structured_outputs=tool_call_structure(body.tool_choice, body.tools))
        fmt = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", engine.model_name, engine.tokenizer, num_logprobs,
                            parser)
        return await service.generate(raw, tenant, body, [ids], params, fmt, "messages")

    @app.post("/v1/responses", responses=_GENERATE_RESPONSES)
    async def responses(body: p.ResponsesRequest, raw: Request, tenant: Tenant = Depends(tenant_of)):
        return await create_response(service, raw, tenant, body)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str, tenant: Tenant = Depends(tenant_of)):
        return service.responses.get(response_id, tenant.name, param="response_id").body

    @app.get("/v1/models", response_model=p.ModelList, responses=_ERRORS)
    async def models(_: Tenant = Depends(tenant_of)):
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "matrixinfer", "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: p.TokenizeRequest, _: Tenant = Depends(tenant_of)):
        service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = service.chat_prompt(body.messages, body.tools)
        else:
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer", param="prompt")
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: p.DetokenizeRequest, _: Tenant = Depends(tenant_of)):
        service.check_model(body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        ids = service.tokenize_prompt(body.tokens, param="tokens") if body.tokens else []
        return {"prompt": engine.tokenizer.decode(ids)}

    @app.get("/health")
    async def health():
        if not hasattr(engine, "role_stats"):
            return {"status": "ok", "model": engine.model_name}
        # PDC: serving needs a live instance of each role; a dead one that is restarting is "degraded"
        roles = engine.role_stats()
        up = {r: any(i["alive"] for i in roles if i["role"] == r) for r in ("prefill", "decode")}
        status = "ok" if all(i["alive"] for i in roles) else "degraded" if all(up.values()) else "down"
        body = {"status": status, "model": engine.model_name,
                "roles": [{k: i[k] for k in ("role", "instance", "alive", "pid", "requests", "restarts", "start_seconds")}
                          for i in roles]}
        return JSONResponse(body, status_code=200 if status != "down" else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
