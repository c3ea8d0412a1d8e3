"""Streaming under load and when the client goes away: 64 concurrent streams finish with
correct usage and the ledger adds up to what the responses reported; a client that
disconnects mid-stream has its request aborted and its cache blocks freed; /metrics shows
the vLLM-style series."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.serving.conftest import start_service


@pytest.fixture
def fresh(engine, tmp_path):
    server, tenants, ledger = start_service(engine, tmp_path / "serving.db")
    yield server, tenants, ledger
    server.stop()
    tenants.close()
    ledger.close()


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_64_concurrent_streams_meter_exactly(fresh):
    """64 concurrent streaming requests (official async client) all finish; each reports the
    prompt length /tokenize gives and exactly max_tokens completion tokens; the ledger's totals
    equal the sum of the responses' usage."""
    server, tenants, ledger = fresh
    key = tenants.add_key("load")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    prompts = [f"def f{i}(x):\n    return x + {i}" for i in range(64)]

    async def one(i):
        stream = await client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=6, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = [], None
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(text), usage

    async def run():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run())
    expected_prompt = [httpx.post(server.url + "/tokenize", json={"prompt": p},
                                  headers={"Authorization": f"Bearer {key}"}).json()["count"] for p in prompts]
    assert [u.prompt_tokens for _, u in results] == expected_prompt
    assert all(u.completion_tokens == 6 and u.total_tokens == u.prompt_tokens + 6 for _, u in results)
    [t] = ledger.totals("load")
    assert t.requests == 64
    assert t.input_tokens == sum(u.prompt_tokens for _, u in results)
    assert t.output_tokens == sum(u.completion_tokens for _, u in results)
    assert t.cached_input_tokens == sum(u.prompt_tokens_details.cached_tokens for _, u in results)


def test_disconnect_aborts_and_frees_cache_blocks(fresh, engine):
    """Closing the connection mid-stream aborts the request: the engine forgets it, every KV
    block is free again, and the ledger meters only the tokens made before the abort."""
    server, _, ledger = fresh
    idle = lambda: (s := engine.stats()).num_running == s.num_waiting == 0 and s.kv_cache_usage == 0  # noqa: E731
    assert _wait(idle)
    body = {"prompt": list(range(10, 30)), "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: {") for line in got)
        assert _wait(lambda: engine.stats().kv_cache_usage > 0)  # the request holds blocks now
    assert _wait(idle)
    assert not engine.output_processor.requests
    assert _wait(lambda: bool(ledger.totals()))
    [t] = ledger.totals()
    assert t.requests == 1 and 0 < t.output_tokens < 100


def test_non_stream_disconnect_aborts_too(fresh, engine):
    """A non-streaming client that gives up (read timeout closes the connection) also has its
    request aborted and its blocks freed, and is metered for what was made."""
    server, _, ledger = fresh
    body = {"prompt": list(range(10, 15)), "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    assert _wait(lambda: (s := engine.stats()).num_running == s.num_waiting == 0 and s.kv_cache_usage == 0)
    assert _wait(lambda: not engine.output_processor.requests)
    assert _wait(lambda: bool(ledger.totals()))
    assert 0 < ledger.totals()[0].output_tokens < 120


def test_stream_ends_with_done(fresh):
    """The raw event stream is `data: {json}` events and ends with `data: [DONE]`."""
    server = fresh[0]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_metrics_endpoint_has_vllm_style_series(fresh):
    """/metrics exposes running/waiting, TTFT/TPOT/E2E histograms, per-tenant token counters,
    prefix-cache queries and hits, and KV-cache usage, with values that moved."""
    server = fresh[0]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4,
                                                          "ignore_eos": True})
    assert r.status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ["matrixinfer:num_requests_running", "matrixinfer:num_requests_waiting",
                 "matrixinfer:kv_cache_usage_perc", "matrixinfer:prefix_cache_queries_total",
                 "matrixinfer:prefix_cache_hits_total", "matrixinfer:time_to_first_token_seconds_bucket",
                 "matrixinfer:time_per_output_token_seconds_bucket", "matrixinfer:e2e_request_latency_seconds_count"]:
        assert name in text, name
    assert 'matrixinfer:generation_tokens_total{model_name="tiny",tenant="anonymous"} 4.0' in text
    assert 'matrixinfer:e2e_request_latency_seconds_count{model_name="tiny"} 1.0' in text
