"""Structured-output fields of a request -> StructuredOutputsParams, checked here (a malformed
schema, regex or grammar is a 400 naming its field) with the function the worker compiles
with (worker/structured_output.py), so what is accepted compiles.

OpenAI's `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (EBNF); at most one per request. A forced
tool call (tool_choice required or named) becomes a grammar too: its arguments validate
against the function's parameter schema and the call's end marker follows.
"""

from __future__ import annotations

import json

from matrixinfer.engine.sampling_params import StructuredOutputsParams
from matrixinfer.serving import protocol as p
from matrixinfer.serving.errors import APIError
from matrixinfer.serving.tool_parsers import ARGS_BEGIN, ARGS_END, CALLS_END


def _checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    from matrixinfer.worker.structured_output import build_grammar

    try:
        build_grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError with the parser's message
        raise APIError(400, f"{param}: {str(e).strip().splitlines()[-1]}", param=param) from e
    return spec


def request_structure(body: p._SamplingRequest) -> StructuredOutputsParams | None:
    """The grammar the request's fields ask for, or None."""
    fields = {name: getattr(body, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
              if getattr(body, name) is not None}
    rf = body.response_format
    if rf is not None and rf.type != "text":
        fields["response_format"] = rf
    if len(fields) > 1:
        raise APIError(400, f"give at most one of {', '.join(fields)}", param=list(fields)[1])
    if not fields:
        return None
    (name, value), = fields.items()
    if name == "response_format":
        if value.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (value.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format.json_schema")
        return _checked(StructuredOutputsParams(json=json.dumps(schema)), "response_format.json_schema")
    if name == "guided_json":
        return _checked(StructuredOutputsParams(json=value if isinstance(value, str) else json.dumps(value)), name)
    if name == "guided_regex":
        return _checked(StructuredOutputsParams(regex=value), name)
    if name == "guided_choice":
        if not value or any(not c for c in value):
            raise APIError(400, "guided_choice must be a non-empty list of non-empty strings", param=name)
        return StructuredOutputsParams(choice=tuple(value))
    return _checked(StructuredOutputsParams(grammar=value), name)


def _schema(tool: p.Tool) -> str:
    return json.dumps(tool.function.parameters or {"type": "object"})


def tool_call_structure(tool_choice, tools: list[p.Tool]) -> StructuredOutputsParams:
    """A forced call's grammar after the prompt's opening (chat_prompt.forced_call): the
    arguments of the named (or only) function, or one function's name and arguments."""
    suffix = ARGS_END + CALLS_END  # one call (several would need a repeat the grammar lacks: not offered)
    if isinstance(tool_choice, p.NamedToolChoice) or len(tools) == 1:
        name = tool_choice.function.name if isinstance(tool_choice, p.NamedToolChoice) else tools[0].function.name
        tool = next(t for t in tools if t.function.name == name)
        return _checked(StructuredOutputsParams(json=_schema(tool), suffix=suffix), "tools")
    return _checked(StructuredOutputsParams(alternatives=tuple((t.function.name + ARGS_BEGIN, _schema(t))
                                                               for t in tools), suffix=suffix), "tools")
