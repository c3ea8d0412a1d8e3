"""Structured outputs through the real bundled_server with the official `openai` bundled_client, on the
bundled model (which has never seen JSON): every completion drawn at temperature 1.0 under a
schema parses and validates; regex, choice, json_object; a forced tool call's arguments
validate against the function's schema; malformed grammars are 400s naming the field."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "a person as JSON"}]


def _valid(obj) -> bool:
    return (set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str) and len(obj["name"]) <= 8
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 150 and len(obj["tags"]) <= 3
            and all(t in ("a", "b") for t in obj["tags"]))


def test_fifty_sampled_completions_under_a_schema_all_validate(bundled_client):
    """50 chat completions at temperature 1.0 with response_format json_schema: every one
    ends (stop, not length) and is a JSON object of the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def draw(seed):  # n is at most 16 per request: four concurrent requests, one batch in the engine
        return bundled_client.chat.completions.create(model="tiny-moe", messages=MSGS, n=13 if seed < 2 else 12,
                                              temperature=1.0, seed=seed, max_tokens=120, response_format=fmt).choices

    with ThreadPoolExecutor(4) as pool:
        choices = [c for cs in pool.map(draw, range(4)) for c in cs]
    assert len(choices) == 50
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        assert _valid(json.loads(c.message.content)), c.message.content


def test_parse_with_a_pydantic_model(bundled_client):
    """The openai bundled_client's chat.completions.parse with a pydantic model gets a parsed object."""
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=-9, le=9)
        y: int = Field(ge=-9, le=9)

    r = bundled_client.chat.completions.parse(model="tiny-moe", messages=MSGS, temperature=1.0, seed=1, max_tokens=40,
                                      response_format=Point)
    p = r.choices[0].message.parsed
    assert isinstance(p, Point) and -9 <= p.x <= 9


def test_completions_with_regex_choice_and_json_object(bundled_client):
    """guided_regex, guided_choice and json_object constrain /v1/completions too (streamed the
    text is the same grammar's)."""
    kw = dict(model="tiny-moe", prompt="x = ", temperature=1.0, max_tokens=40, n=4, seed=3)
    r = bundled_client.completions.create(**kw, extra_body={"guided_regex": r"[0-9]{1,3}(\.[0-9]{1,2})?"})
    assert all(re.fullmatch(r"[0-9]{1,3}(\.[0-9]{1,2})?", c.text) for c in r.choices)
    r = bundled_client.completions.create(**kw, extra_body={"guided_choice": ["None", "True", "False"]})
    assert all(c.text in ("None", "True", "False") for c in r.choices)
    chunks = list(bundled_client.completions.create(**{**kw, "n": 1}, stream=True, extra_body={"guided_choice": ["spam", "eggs"]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("spam", "eggs")
    r = bundled_client.chat.completions.create(model="tiny-moe", messages=MSGS, temperature=1.0, max_tokens=30, seed=5, n=2,
                                       response_format={"type": "json_object"})
    assert all(isinstance(json.loads(c.message.content), dict) for c in r.choices if c.finish_reason == "stop")


def test_forced_tool_calls_have_valid_arguments(bundled_client):
    """tool_choice named or required: the arguments parse and validate against the chosen
    function's schema, and the choice finishes with tool_calls."""
    tools = [{"type": "function", "function": {"name": "person", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "noop", "parameters": {
                 "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}}}]
    for choice in ({"type": "function", "function": {"name": "person"}}, "required"):
        r = bundled_client.chat.completions.create(model="tiny-moe", messages=MSGS, tools=tools, tool_choice=choice, n=2,
                                           temperature=1.0, seed=7, max_tokens=120)
        for c in r.choices:
            assert c.finish_reason == "tool_calls", c
            call, = c.message.tool_calls
            args = json.loads(call.function.arguments)
            assert _valid(args) if call.function.name == "person" else args in ({"ok": True}, {"ok": False})
            if choice != "required":
                assert call.function.name == "person"


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_json": {"type": "objekt"}}, "guided_json"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_malformed_structures_are_400s(bundled_server, body, param):
    """A grammar that does not compile is a 400 naming its field, before any generation."""
    r = httpx.post(bundled_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
