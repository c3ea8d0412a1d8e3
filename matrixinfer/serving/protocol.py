"""Request and response bodies of the OpenAI-compatible API (pydantic, so /openapi.json is
their schema). Requests forbid unknown fields: a typo is a 400 naming the field, not a
silently ignored parameter."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
MAX_SEED = 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _SamplingRequest(_Request):
    model: str | None = Field(None, description="the served model's id (see /v1/models); may be omitted")
    max_tokens: int | None = Field(None, ge=1, description="default: what the context leaves after the prompt")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; -1 or 0 disables")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None, description="up to 4 non-empty strings")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="end-user id, recorded in the usage ledger")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted once from every token already "
                                           "in the output")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="subtracted per occurrence in the output")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100] "
                                                "added to its logit")
    response_format: ResponseFormat | None = Field(None, description="text, json_object, or json_schema "
                                                   "({\"json_schema\": {\"name\", \"schema\", \"strict\"}}): "
                                                   "the output is constrained to the grammar")
    guided_json: dict | str | None = Field(None, description="vLLM extension: a JSON schema the output matches")
    guided_regex: str | None = Field(None, description="vLLM extension: a regex the output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM extension: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM extension: an EBNF grammar (xgrammar's dialect)")
    # vLLM's extensions (its OpenAI server accepts them; `vllm bench serve` sends repetition_penalty)
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past end-of-sequence")
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM extension: >1 discourages tokens of the "
                                             "prompt and output")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: no end-of-sequence or stop token before this many")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension: token ids that end the choice")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string in the text")
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of the text")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either (a batch: one set of n choices per prompt)")
    logprobs: int | None = Field(None, ge=0, le=5, description="also return this many most likely tokens per position")
    echo: bool = Field(False, description="prefix each choice's text with its prompt")
    suffix: str | None = Field(None, description="text after the completion: refused (no fill-in-the-middle model)")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="generate this many per prompt, return the n with "
                                "the highest cumulative log probability (not with stream)")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str = Field(..., description="the arguments as a JSON string, as the model wrote them")


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant only: the calls it made")
    tool_call_id: str | None = Field(None, description="tool only: the call this message answers")


class FunctionDefinition(_Request):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="JSON schema of the arguments (shown to the model; the "
                                    "grammar of a forced call's arguments)")
    strict: bool | None = Field(None, description="accepted; a forced call's arguments always follow the schema, "
                                "an auto call's are not constrained")


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="same as max_tokens (newer name)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools; required / a named function open the call in the prompt")
    parallel_tool_calls: bool | None = Field(None, description="false: only the first call is returned")


# -- the Responses API ------------------------------------------------------------------------------
class InputText(_Request):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as input
    text: str
    annotations: list | None = None


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # as sent back from an earlier response's output
    status: str | None = None


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputMessage] = Field(..., description="text (a user message) or messages")
    instructions: str | None = Field(None, description="a system message before the input, for this turn only")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = Field(None, description="continue that response's conversation (its "
                                             "tokens are reused from the prefix cache)")
    store: bool = Field(True, description="keep the response (in memory) for previous_response_id and GET")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema (structured outputs)")
    tools: list[dict] | None = Field(None, description="refused unless empty: use /v1/chat/completions for tools")
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses (for the schema; handlers build plain dicts of the same shape) --------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: dict


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


SSE_EVENT_SCHEMA = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "description": "With stream=true: server-sent events, each `data: <chunk JSON>` (OpenAI's chunk format), "
                   "the last one `data: [DONE]`.",
}
