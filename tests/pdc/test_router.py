"""The peer scheduler's policies, on stand-in instances (the router reads only their load)."""

from types import SimpleNamespace

from matrixinfer.engine.messages import SchedulerStats
from matrixinfer.pdc.router import Locality, make_router


def inst(name, queued=0, requests=0, kv=0.0):
    role, index = name.split("-")
    return SimpleNamespace(name=name, role=role, index=int(index), queued_prompt_tokens=queued,
                           num_requests=requests, stats=SchedulerStats(kv_cache_usage=kv))


def test_least_loaded_ignores_locality_and_balances_queued_work():
    r = make_router("least-loaded", block_size=4)
    a, b = inst("prefill-0", queued=100), inst("prefill-1", queued=10)
    assert r.choose_prefill([a, b], list(range(64)), "t") is b
    d0, d1 = inst("decode-0", requests=3, kv=0.1), inst("decode-1", requests=3, kv=0.5)
    assert r.choose_decode([d0, d1]) is d0  # same requests: more free KV wins
    assert r.choose_decode([inst("decode-0", requests=4), d1]) is d1


def test_locality_prefers_the_instance_that_prefilled_the_prefix_unless_it_is_swamped():
    r = Locality(block_size=4, weight=1.0)
    a, b = inst("prefill-0"), inst("prefill-1")
    prompt = list(range(64))  # 16 blocks
    r.observe(a, prompt, "t")
    assert r.choose_prefill([a, b], prompt + [1, 2], "t") is a
    assert r.choose_prefill([a, b], prompt, "other-tenant") is a  # tie (nothing cached for it): lowest index
    assert r.choose_prefill([inst("prefill-0", queued=4 * 100), b], prompt, "t").name == "prefill-1"


def test_round_robin_alternates():
    r = make_router("round-robin", block_size=4)
    a, b = inst("prefill-0"), inst("prefill-1")
    assert [r.choose_prefill([a, b], [1], "").name for _ in range(4)] == ["prefill-0", "prefill-1"] * 2
