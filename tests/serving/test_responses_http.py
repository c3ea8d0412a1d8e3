"""The Responses API through the real server with the official `openai` client, on the
bundled model: the response object and its stream events in OpenAI's shape, the same text as
chat, and a second turn by previous_response_id that reuses the first turn's prompt and
answer from the prefix cache."""

import httpx
import openai
import pytest

from tests.serving.conftest import start_service

BLOCK = 16  # the bundled engine's KV block size (EngineConfig's default)
INSTRUCTIONS = "You write short Python functions."
INPUT = "def read_lines(path):"


@pytest.fixture(scope="module")
def keyed(bundled_engine, tmp_path_factory):
    """A server with two tenants' keys: responses are each tenant's own."""
    server, tenants, ledger = start_service(bundled_engine, tmp_path_factory.mktemp("resp") / "serving.db")
    keys = [tenants.add_key(name) for name in ("alice", "bob")]
    clients = [openai.OpenAI(base_url=server.url + "/v1", api_key=k, max_retries=0, timeout=60) for k in keys]
    yield server, clients
    server.stop()
    tenants.close()
    ledger.close()


@pytest.fixture(scope="module")
def client(keyed):
    return keyed[1][0]


def _create(client, **kw):
    return client.responses.create(**{"model": "tiny-moe", "instructions": INSTRUCTIONS, "temperature": 0,
                                      "max_output_tokens": 12, "input": INPUT, **kw})


def test_response_object_matches_chat(client):
    """A response carries one assistant message whose text is the greedy chat answer to the
    same instructions and input; usage counts the same prompt."""
    r = _create(client)
    chat = client.chat.completions.create(model="tiny-moe", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": INPUT}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-moe"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)


def test_stream_events_in_order_and_add_up(client):
    """The stream is OpenAI's event sequence, numbered from 0; the text deltas add up to the
    non-streamed text and the last event carries the whole response with usage."""
    full = _create(client).output_text
    events = list(_create(client, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full
    assert events[-4].text == full and events[-1].response.output_text == full
    assert events[-1].response.usage.output_tokens > 0


def test_previous_response_id_reuses_the_first_turn_from_the_cache(client):
    """The second turn's prompt starts with the first turn's prompt and answer token for
    token: every full KV block of them is a prefix-cache hit (cached_tokens), streamed or not."""
    first = _create(client, input=INPUT + " # " + "x" * 40)
    for stream in (False, True):
        kw = dict(previous_response_id=first.id, input="and now write it again")
        second = _create(client, **kw) if not stream else list(_create(client, stream=True, **kw))[-1].response
        reused = (first.usage.input_tokens + first.usage.output_tokens - 1) // BLOCK * BLOCK
        assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.total_tokens
        assert second.usage.input_tokens_details.cached_tokens >= reused > first.usage.input_tokens - BLOCK


def test_stored_response_is_the_tenants_own(keyed, client):
    """GET /v1/responses/{id} returns a stored response to its tenant; to another tenant, and
    as previous_response_id of another tenant, it is a 404 like an unknown id."""
    r = _create(client)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    other = keyed[1][1]
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        _create(other, previous_response_id=r.id)


def test_store_false_is_not_kept(client):
    """store=false: the response cannot be continued."""
    r = _create(client, store=False)
    with pytest.raises(openai.NotFoundError):
        _create(client, previous_response_id=r.id)


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "objekt"}}}},
     "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
])
def test_malformed_requests_are_400s_naming_the_field(keyed, body, param):
    """Refused and malformed fields are 400s whose param names them."""
    server, _ = keyed
    key = keyed[1][0].api_key
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_text_format_json_schema_constrains_the_answer(client):
    """text.format json_schema: the answer parses and validates (structured outputs, as chat's
    response_format); the response echoes the format."""
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = _create(client, temperature=1.0, max_output_tokens=30,
                text={"format": {"type": "json_schema", "name": "flag", "schema": schema, "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text) in ({"ok": True}, {"ok": False})
    assert r.text.format.type == "json_schema" and r.text.format.name == "flag"
