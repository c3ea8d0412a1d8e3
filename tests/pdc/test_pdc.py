"""The P/D/C stack for real: an EMS pool, prefill and decode instances as separate engine
core processes, the peer scheduler, the HTTP API in front. Checked against the colocated
engine (greedy, token for token) and through failures (kill -9 of instances and of the
EMS server): streams go on or end with a clear error, never hang, and blocks held return to
their baseline."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import EngineConfig
from matrixinfer.pdc import start_pdc
from matrixinfer.serving import TenantStore, UsageLedger, build_app
from tests.serving.conftest import LiveServer

pytestmark = pytest.mark.slow
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=128)
MODEL_CACHE = dict(load_format="ems")  # the main stack's instances load their weights through EMS
PROMPTS = ["def parse(line):\n    return line.split(',')\n\n\ndef main", "import os\nimport sys\n", "class A:"]


def _stack(checkpoint, prefill, decode, router="least-loaded", restart=True, **extra):
    base = EngineConfig.from_kwargs(str(checkpoint), **ENGINE, **extra)
    return start_pdc(base, prefill, decode, ems_servers=1, router=router, model_name="tiny", restart_instances=restart)


def _serve(client, tmp_path):
    tenants, ledger = TenantStore(tmp_path / "db"), UsageLedger(tmp_path / "db")
    return LiveServer(build_app(client, tenants, ledger)), tenants, ledger


def _complete(server, prompt, max_tokens=24, stream=False, headers=None):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
    return text, None


class Reference(dict):
    """Greedy text of the colocated engine, computed on first use of each prompt."""

    def __init__(self, checkpoint):
        super().__init__()
        self.llm = LLM(model=checkpoint, **ENGINE)

    def __missing__(self, prompt):
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        self[prompt] = self.llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].text
        return self[prompt]


@pytest.fixture(scope="module")
def reference(text_checkpoint):
    return Reference(text_checkpoint[0])


@pytest.fixture(scope="module")
def stack(text_checkpoint, tmp_path_factory):
    client = _stack(text_checkpoint[0], prefill=1, decode=1, **MODEL_CACHE)
    server, tenants, ledger = _serve(client, tmp_path_factory.mktemp("pdc"))
    yield client, server, tenants
    server.stop()
    tenants.close()
    ledger.close()
    client.shutdown()


def _idle(client, timeout=20):
    """Every live instance back to no requests and no blocks in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = [i for i in client.instances if i.alive]
        if all(not i.requests and i.stats.kv_cache_usage == 0 and i.stats.num_running == 0 for i in live):
            return True
        time.sleep(0.05)
    return False


def test_greedy_through_pdc_equals_the_colocated_engine(stack, reference):
    """Prompts longer than a block and a chunk, streamed and not, several at once: the same
    text as one colocated engine; every request was handed from prefill to decode."""
    client, server, _ = stack
    for p in PROMPTS:
        assert _complete(server, p)[0] == reference[p]
        assert _complete(server, p, stream=True)[0] == reference[p]

    async def concurrent():
        async with httpx.AsyncClient(timeout=120) as c:
            body = lambda p: {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}  # noqa: E731
            rs = await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body(p)) for p in PROMPTS * 2))
            return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(concurrent()) == [reference[p] for p in PROMPTS * 2]
    import openai

    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = oa.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True})
    assert got.choices[0].text == reference[PROMPTS[0]]
    chunks = oa.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == reference[PROMPTS[2]]
    assert client.prefill[0].handed_off >= len(PROMPTS) * 4
    assert client.scheduler_stats().external_cache_hits > 0  # decode loaded prompts' blocks from EMS
    assert _idle(client)


def test_tenants_are_namespaces_with_no_cross_tenant_hits(stack, tmp_path):
    """The same prompt from a second tenant reuses nothing; the same tenant's repeat reuses
    its prefix (usage.prompt_tokens_details.cached_tokens)."""
    client, server, tenants = stack
    a, b = tenants.add_key("tenant-a"), tenants.add_key("tenant-b")
    prompt = PROMPTS[0] * 2
    _, first = _complete(server, prompt, headers={"Authorization": f"Bearer {a}"})
    _, other = _complete(server, prompt, headers={"Authorization": f"Bearer {b}"})
    _, again = _complete(server, prompt, headers={"Authorization": f"Bearer {a}"})
    cached = lambda u: (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # noqa: E731
    assert cached(first) == 0 and cached(other) == 0
    assert cached(again) >= first["prompt_tokens"] - 4


@pytest.fixture
def failover_stack(text_checkpoint, tmp_path):
    client = _stack(text_checkpoint[0], prefill=2, decode=2, router="round-robin", restart=False)
    server, tenants, ledger = _serve(client, tmp_path)
    try:
        yield client, server
    finally:
        server.stop()
        tenants.close()
        ledger.close()
        client.shutdown()


def _kill(instance):
    instance.client.kill()  # SIGKILL of the instance's engine core process


def test_instances_killed_mid_stream_and_with_none_left(failover_stack, reference):
    """kill -9 a prefill instance: prompts go to the other. kill -9 the decode instance a
    stream is on: the stream goes on elsewhere with no token lost or repeated. With no decode
    instance left: a clear error, not a hang. Blocks in use return to baseline each time."""
    client, server = failover_stack
    _kill(client.prefill[0])
    for p in PROMPTS:
        assert _complete(server, p)[0] == reference[p]
    assert _idle(client)

    p = PROMPTS[0]
    body = {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    text, killed = "", False
    import json

    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            if not killed and len(text) > 0:
                busy = [i for i in client.decode if i.requests]
                if busy:
                    _kill(busy[0])
                    killed = True
    assert killed and text == reference[p]
    assert _idle(client)

    for inst in client.decode:
        if inst.alive:
            _kill(inst)
    t = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 8}, timeout=60)
    assert r.status_code >= 500 and "decode instance" in r.text
    assert time.monotonic() - t < 30


def test_roles_are_visible_in_ps_health_and_metrics(stack):
    """Each role's process is titled for `ps`; /health lists the roles; every series the
    shipped Grafana dashboard plots is on /metrics."""
    import json
    import re
    from pathlib import Path

    client, server, tenants = stack
    # model cache: the two instances loaded concurrently and the directory was read once
    reports = [i.client.weights_report for i in client.instances]
    assert sum(r["bytes_from_source"] for r in reports) == reports[0]["bytes_total"]
    for inst in client.instances:
        cmdline = Path(f"/proc/{inst.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert cmdline.startswith(f"matrixinfer::{inst.name}")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and {r["instance"] for r in health["roles"]} == {"prefill-0", "decode-0"}
    metrics = httpx.get(server.url + "/metrics").text
    exposed = set(re.findall(r"^(matrixinfer:[a-z_]+)", metrics, re.M))
    dashboard = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "matrixinfer-pdc.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
    plotted = {m for e in exprs for m in re.findall(r"matrixinfer:[a-z_]+", e)}
    assert plotted and plotted <= exposed, plotted - exposed
    assert 'matrixinfer:pdc_kv_handoff_seconds_count{model_name="tiny"} 0.0' not in metrics  # hand-offs observed


def test_a_killed_instance_restarts_rejoins_and_takes_load(stack, reference):
    """kill -9 the only decode instance: the front end starts a new process for it, /health
    says degraded until it is back, and then it serves requests."""
    client, server, tenants = stack
    auth = {"Authorization": f"Bearer {tenants.add_key('tenant-r')}"}
    old = client.decode[0]
    _kill(old)
    deadline = time.monotonic() + 120
    while not (client.decode[0] is not old and client.decode[0].alive):
        assert time.monotonic() < deadline, "decode-0 did not come back"
        time.sleep(0.2)
    new = client.decode[0]
    assert new.pid != old.pid and new.restarts == 1
    # warm start: every weight byte came from the EMS model cache, none from the model directory
    assert new.client.weights_report["bytes_from_source"] == 0 and new.client.weights_report["bytes_from_pool"] > 0
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert _complete(server, PROMPTS[1], headers=auth)[0] == reference[PROMPTS[1]]
    assert new.stats.decode_tokens > 0


def test_a_killed_ems_server_costs_recomputation_not_requests(stack, reference):
    """Last in this module: with the pool's only MP server gone, decode instances find no
    pages, recompute the prompt and answer exactly as before."""
    client, server, tenants = stack
    auth = {"Authorization": f"Bearer {tenants.add_key('tenant-c')}"}
    before = client.scheduler_stats().external_cache_hits
    client.ems_cluster.kill_server(0)
    for p in PROMPTS:
        assert _complete(server, p + " ", headers=auth)[0] == reference[p + " "]
    assert client.scheduler_stats().external_cache_hits == before
    assert _idle(client)


def test_decode_instances_speculate_with_mtp_and_keep_greedy_output(tmp_path):
    """Prefill and decode instances with MTP speculation (the bundled model ships an MTP
    module): the decode instance drafts from the KV it loaded and the text equals the colocated
    engine's without speculation; the acceptance counters reach the front end."""
    from matrixinfer.config import DEFAULT_MODEL

    reference = Reference(DEFAULT_MODEL)
    client = _stack(DEFAULT_MODEL, prefill=1, decode=1,
                    speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    server, tenants, ledger = _serve(client, tmp_path)
    try:
        for p in PROMPTS[:2]:
            assert _complete(server, p)[0] == reference[p]
        stats = client.scheduler_stats()
        assert stats.external_cache_hits > 0 and stats.spec_num_accepted_tokens > 0
        assert "matrixinfer:spec_decode_num_drafts_total" in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
        tenants.close()
        ledger.close()
        client.shutdown()


@pytest.mark.parametrize("layout", [
    dict(prefill_parallel="sp-tp-sp", prefill_parallel_size=2),  # the prefill role's; decode runs one process
    dict(expert_parallel_size=2, enable_prefix_caching=False),  # both roles EP groups
])
def test_instances_as_rank_groups_keep_greedy_output(text_checkpoint, reference, tmp_path, layout):
    """A PDC instance's engine core starts its own rank processes: an SP-TP-SP prefill instance
    (2 ranks) hands its latent KV through EMS to a one-process decode instance, or both roles
    are EP=2 groups; either way the text equals the colocated engine's, and no process of the
    stack outlives its shutdown."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' stacks
    client = _stack(text_checkpoint[0], prefill=1, decode=1, **layout)
    server, tenants, ledger = _serve(client, tmp_path)
    try:
        assert client.prefill[0].config.parallel.world_size == 2
        assert client.decode[0].config.parallel.world_size == (2 if "expert_parallel_size" in layout else 1)
        for p in PROMPTS[:2]:
            assert _complete(server, p)[0] == reference[p]
        assert client.scheduler_stats().external_cache_hits > 0  # decode continued from the prefill's pages
    finally:
        server.stop()
        tenants.close()
        ledger.close()
        client.shutdown()
    def ours():
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]
        return [p for p in procs if "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own

    deadline = time.time() + 20
    while ours() and time.time() < deadline:
        time.sleep(0.2)
    assert not ours()


def test_failover_under_batch_invariance_resumes_with_the_solo_text(text_checkpoint, tmp_path):
    """bfloat16 with batch_invariant on every instance: four concurrent streams over two decode
    instances, kill -9 of the busier one after the first tokens. Each stream resumes elsewhere
    (prompt + the tokens it already sent) and its whole text equals the offline engine's run of
    that prompt alone: every token once, none different (issue: without the mode only 1 of 4)."""
    import json

    engine = dict(ENGINE, dtype="bfloat16", batch_invariant=True)
    offline = LLM(model=text_checkpoint[0], **engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS + ["x = [1, 2, 3]\nfor v in x:\n"]
    solo = {p: offline.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts}
    offline.shutdown()
    base = EngineConfig.from_kwargs(str(text_checkpoint[0]), **engine)
    client = start_pdc(base, 1, 2, ems_servers=1, router="round-robin", model_name="tiny", restart_instances=False)
    server, tenants, ledger = _serve(client, tmp_path)
    killed = []

    async def stream(http, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = ""
        async with http.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    busy = sorted((i for i in client.decode if i.alive and i.requests), key=lambda i: -len(i.requests))
                    if not killed and text and busy:
                        killed.append(busy[0])
                        _kill(busy[0])
        return text

    async def run_all():
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(stream(http, p) for p in prompts))

    try:
        texts = asyncio.run(asyncio.wait_for(run_all(), timeout=240))
        assert killed, "no decode instance was busy to kill"
        assert texts == [solo[p] for p in prompts]
    finally:
        server.stop()
        tenants.close()
        ledger.close()
        client.shutdown()


def test_structured_outputs_survive_the_prefill_to_decode_hand_off(stack):
    """Prefill samples the first token under the grammar, decode goes on from it (the token is
    in its prompt, and its grammar has read it): sampled completions under a schema validate
    (before, the grammar restarted on the decode instance and wrote '{{')."""
    import json

    _, server, tenants = stack
    auth = {"Authorization": f"Bearer {tenants.add_key('tenant-g')}"}  # keys exist once a test made one
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 20,
                                                         "temperature": 1.0, "n": 4, "seed": 0, "guided_json": schema},
                   headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop" and 0 <= json.loads(c["text"])["a"] <= 9, c
