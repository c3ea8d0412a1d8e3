"""The API depends only on the EngineClient interface (generate / abort / stats), so a PDC
front end can replace AsyncLLMEngine; and an engine failure is a 500 for the requests in
flight, never a dead server."""

import asyncio

import httpx
import pytest

from matrixinfer.frontend.outputs import CompletionOutput, RequestOutput
from matrixinfer.serving import AsyncLLMEngine, EngineStats, build_app
from tests.serving.conftest import LiveServer, start_service


class EchoEngine:
    """Not an LLMEngine at all: 'generates' the prompt's token ids back, one per step."""

    model_name, max_model_len, tokenizer, vocab_size = "echo", 64, None, 1000

    def __init__(self, fail_after: int | None = None):
        self.fail_after = fail_after
        self.aborted: list[str] = []

    async def generate(self, request):
        ids = request.prompt_token_ids[: request.params.max_tokens]
        for i in range(1, len(ids) + 1):
            await asyncio.sleep(0)
            if self.fail_after is not None and i > self.fail_after:
                raise RuntimeError("decode pool lost")
            done = i == len(ids)
            out = CompletionOutput(0, "", ids[:i], finish_reason="length" if done else None)
            yield RequestOutput(request.request_id, None, request.prompt_token_ids, [out], done)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return EngineStats(num_running=3)


@pytest.fixture
def echo_server():
    servers = []

    def make(engine):
        servers.append(LiveServer(build_app(engine)))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def test_any_engine_client_serves_the_api(echo_server):
    """An engine that is not an LLMEngine serves completions with usage, streams, and its stats
    appear in /metrics."""
    server = echo_server(EchoEngine())
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "stream": True, "logprobs": None})
    assert r.text.rstrip().endswith("data: [DONE]")
    assert 'matrixinfer:num_requests_running{model_name="echo"} 3.0' in httpx.get(server.url + "/metrics").text


def test_engine_failure_is_a_500_and_the_server_lives(echo_server):
    """A failure inside generation: a non-streamed request gets a 500 in OpenAI's error shape,
    a streamed one an error event and [DONE]; the next request is served."""
    server = echo_server(EchoEngine(fail_after=0))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "stream": True})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"  # failed before the first token
    server = echo_server(EchoEngine(fail_after=1))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "stream": True})
    events = [line for line in r.text.splitlines() if line]
    assert "decode pool lost" in events[-2] and events[-1] == "data: [DONE]"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200


def test_a_failing_engine_step_fails_only_the_requests_in_flight(text_checkpoint, tmp_path, monkeypatch):
    """When an engine step raises, the front end fails the requests in flight (500), the core
    frees their blocks, and keeps stepping for the next request (core stepped by a thread)."""
    engine = AsyncLLMEngine.from_model(text_checkpoint[0], model_name="tiny", engine_core_process=False,
                                       dtype="float32", block_size=4, max_model_len=128)
    core = engine.core.inner.core
    real_step, calls = core.step, []

    def broken_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel fault")
        return real_step()

    monkeypatch.setattr(core, "step", broken_step)
    server, tenants, ledger = start_service(engine, tmp_path / "serving.db")
    try:
        body = {"prompt": list(range(10, 20)), "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "kernel fault" in r.json()["error"]["message"]
        assert not core.scheduler.requests and core.kv.num_free_blocks == core.kv.num_blocks
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()
        tenants.close()
        ledger.close()
        engine.shutdown()


def test_a_killed_engine_core_process_fails_requests_instead_of_hanging(text_checkpoint, tmp_path):
    """The engine core runs in its own process; if it dies, streams in flight end with an
    error and new requests get a 500 at once: nothing hangs."""
    engine = AsyncLLMEngine.from_model(text_checkpoint[0], model_name="tiny", dtype="float32", block_size=4,
                                       max_model_len=128)
    server, tenants, ledger = start_service(engine, tmp_path / "serving.db")
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 4}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        engine.core.proc.kill()
        engine.core.proc.join(10)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500
    finally:
        server.stop()
        tenants.close()
        ledger.close()
        engine.shutdown()


class SpeculatingEngine(EchoEngine):
    def stats(self):
        return EngineStats(spec_num_drafts=10, spec_num_draft_tokens=20, spec_num_accepted_tokens=13,
                           spec_accepted_per_pos=(8, 5))


def test_speculative_decoding_counters_in_metrics(echo_server):
    """vLLM's spec-decode counters (drafts, draft tokens, accepted, accepted per position) and the
    mean acceptance length appear once an engine speculates."""
    text = httpx.get(echo_server(SpeculatingEngine()).url + "/metrics").text
    for line in ['matrixinfer:spec_decode_num_drafts_total{model_name="echo"} 10.0',
                 'matrixinfer:spec_decode_num_draft_tokens_total{model_name="echo"} 20.0',
                 'matrixinfer:spec_decode_num_accepted_tokens_total{model_name="echo"} 13.0',
                 'matrixinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="echo",position="1"} 5.0',
                 'matrixinfer:spec_decode_mean_acceptance_length{model_name="echo"} 2.3']:
        assert line in text
    assert "spec_decode" not in httpx.get(echo_server(EchoEngine()).url + "/metrics").text


def test_a_consumer_that_falls_behind_gets_the_newest_cumulative_output(engine):
    """Outputs are cumulative, so a stream consumer slower than the engine skips to the newest
    one (fewer events, each with everything so far) and ends with what a prompt one gets."""
    from matrixinfer.engine.sampling_params import SamplingParams
    from matrixinfer.serving.async_engine import GenerateRequest

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def run(rid: str, lag_s: float) -> list:
        outs = []
        async for out in engine.generate(GenerateRequest(rid, [5, 6, 7, 8], params)):
            outs.append(out)
            await asyncio.sleep(lag_s)  # a slow client: the engine steps on meanwhile
        return outs

    prompt = asyncio.run(run("prompt-consumer", 0.0))
    slow = asyncio.run(run("slow-consumer", 0.05))
    assert len(slow) < len(prompt) <= 24
    assert [len(o.outputs[0].token_ids) for o in slow] == sorted({len(o.outputs[0].token_ids) for o in slow})
    assert slow[-1].finished and slow[-1].outputs[0].token_ids == prompt[-1].outputs[0].token_ids
    assert slow[-1].outputs[0].text == prompt[-1].outputs[0].text
