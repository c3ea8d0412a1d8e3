"""Namespaces with replicas, against real MP server processes killed with SIGKILL: no miss for
what was written before a death, re-replication back to N copies, and its cost reported."""

import asyncio
import time

import pytest

from matrixinfer.ems import AsyncEMSClient
from matrixinfer.ems.protocol import call_once
from tests.ems.test_failures import value_for

pytestmark = pytest.mark.timeout(60)


def _holders_of(client, keys):
    return {k: client.holders(k) for k in keys}


def _async_get_many(controller, ns, keys):
    async def main():
        c = await AsyncEMSClient.connect(controller, ns)
        try:
            return await c.get_many(keys)
        finally:
            await c.close()

    return asyncio.run(main())


@pytest.mark.pool(n_servers=3, dram_bytes=16 << 20, heartbeat_timeout_s=1.0)
def test_kill9_of_one_holder_costs_no_miss_with_two_replicas(fresh_pool, client_factory):
    """Every key of a replicas=2 namespace is stored on two servers; right after one is
    SIGKILLed (still in the view) and after the controller dropped it, the sync client (shared
    memory and TCP) and the async client read every key, right bytes, zero misses."""
    fresh_pool.wait_repaired(3)  # no start-up pass races the puts (the count below is exact)
    writer = client_factory(fresh_pool, "rep2", replicas=2)
    keys = [f"r-{i}" for i in range(240)]
    assert all(writer.put_many([(k, value_for(k)) for k in keys]))
    assert sum(s["counters"]["puts"] for s in writer.stats().values()) == 2 * len(keys)
    victim = fresh_pool.servers[1].id
    lost_copy = [k for k, h in _holders_of(writer, keys).items() if victim in h]
    assert len(lost_copy) > 60  # the victim held a copy of a good part of the keys
    readers = [client_factory(fresh_pool, "rep2"), client_factory(fresh_pool, "rep2", zero_copy=False)]
    fresh_pool.kill_server(1)
    time.sleep(0.15)  # past the same-host readers' liveness check: they no longer read its arena
    for phase in ("killed, still in the view", "dropped from the view"):
        for c in readers:
            assert c.get_many(keys) == [value_for(k) for k in keys], phase
        assert _async_get_many(fresh_pool.controller, "rep2", keys) == [value_for(k) for k in keys], phase
        out = bytearray(8192)
        assert all(readers[1].get_into(k, out) == 8192 and out == value_for(k) for k in lost_copy[:20]), phase
        fresh_pool.wait_members(2)


@pytest.mark.pool(n_servers=3, dram_bytes=16 << 20, heartbeat_timeout_s=1.0)
def test_kill9_with_one_replica_loses_the_victims_keys(fresh_pool, client_factory):
    """The baseline the replicas are for: with replicas=1 the same kill turns the victim's keys
    into misses (so the test above proves something)."""
    c = client_factory(fresh_pool, "rep1")
    keys = [f"o-{i}" for i in range(240)]
    assert all(c.put_many([(k, value_for(k)) for k in keys]))
    victim = fresh_pool.servers[1].id
    owned = {k for k, h in _holders_of(c, keys).items() if h == [victim]}
    fresh_pool.kill_server(1)
    time.sleep(0.15)
    got = dict(zip(keys, c.get_many(keys)))
    assert owned and all(got[k] is None for k in owned)
    assert all(got[k] == value_for(k) for k in keys if k not in owned)


def test_replicas_are_namespace_metadata_kept_by_the_controller(pool, client_factory):
    """create_namespace(replicas=N) is kept by the controller, seen by clients that did not
    set it, and a bad count is refused."""
    from matrixinfer.ems import EMSError

    a = client_factory(pool, "meta")
    assert a.replicas == 1
    assert a.create_namespace("meta", replicas=2, if_absent=True)  # explicit beats implicit
    assert a.replicas == 2 and client_factory(pool, "meta").replicas == 2
    assert call_once(pool.controller, {"op": "ns_list"})["namespaces"]["meta"]["replicas"] == 2
    with pytest.raises(EMSError, match="replicas"):
        a.create_namespace("meta", replicas=0)


@pytest.mark.pool(n_servers=3, dram_bytes=16 << 20, heartbeat_timeout_s=1.0)
def test_pool_rereplicates_after_a_death_so_a_second_death_costs_no_miss(fresh_pool, client_factory):
    """After a holder is SIGKILLed the survivors send each key that lost a copy to its new
    second holder exactly once (objects and bytes in their stats, a log line); then a second
    holder of the same keys dies and the one server left still serves every key."""
    fresh_pool.wait_repaired(3)  # the start-up passes are over: none races the puts
    c = client_factory(fresh_pool, "heal", replicas=2)
    keys = [f"h-{i}" for i in range(240)]
    assert all(c.put_many([(k, value_for(k)) for k in keys]))
    a, b = fresh_pool.servers[0].id, fresh_pool.servers[1].id
    holders = _holders_of(c, keys)
    lost_copy = [k for k in keys if a in holders[k]]
    only_a_and_b = [k for k in keys if set(holders[k]) == {a, b}]
    assert only_a_and_b  # the keys the second death would take without re-replication
    before = {i: s["repair"] for i, s in fresh_pool.wait_repaired(3).items()}
    fresh_pool.kill_server(0)
    st = fresh_pool.wait_repaired(2)
    assert sum(s["repair"]["objects"] - before[i]["objects"] for i, s in st.items()) == len(lost_copy)
    assert sum(s["repair"]["bytes"] - before[i]["bytes"] for i, s in st.items()) == 8192 * len(lost_copy)
    logs = "".join(open(f"{fresh_pool.root}/mp{i}.log").read() for i in (1, 2))
    assert "re-replicated" in logs and "bytes) in" in logs
    fresh_pool.kill_server(1)
    time.sleep(0.15)
    tcp = client_factory(fresh_pool, "heal", zero_copy=False)
    for reader in (c, tcp):
        assert reader.get_many(keys) == [value_for(k) for k in keys]


@pytest.mark.pool(n_servers=3, dram_bytes=16 << 20, heartbeat_timeout_s=1.0)
def test_raising_a_namespaces_replicas_copies_what_it_already_holds(fresh_pool, client_factory):
    """Keys written with one copy get a second once the namespace is redefined with replicas=2
    (the servers hear it in a heartbeat), so a kill -9 afterwards costs no miss."""
    c = client_factory(fresh_pool, "grow")
    keys = [f"g-{i}" for i in range(120)]
    assert all(c.put_many([(k, value_for(k)) for k in keys]))
    before = {i: s["repair"]["objects"] for i, s in fresh_pool.wait_repaired(3).items()}
    assert c.create_namespace("grow", replicas=2)
    deadline = time.monotonic() + 20
    while sum(s["repair"]["objects"] - before[i] for i, s in c.stats().items()) < len(keys):
        assert time.monotonic() < deadline, c.stats()
        time.sleep(0.1)
    assert sum(s["repair"]["objects"] - before[i] for i, s in c.stats().items()) == len(keys)
    fresh_pool.kill_server(0)
    time.sleep(0.15)
    assert c.get_many(keys) == [value_for(k) for k in keys]


@pytest.mark.pool(n_servers=2, dram_bytes=8 << 20)
def test_a_quota_counts_each_object_once_whatever_its_replicas(fresh_pool, client_factory):
    """With replicas=2 on 2 servers each server holds every object, so each enforces the whole
    quota (not half of it): filled past its quota, the namespace holds up to Q on each server,
    Q of distinct objects, and never more."""
    from tests.ems.test_control_state import _fill, _ns_usage, _wait_shares

    q_dram, q_ssd = 2 << 20, 3 << 20
    c = client_factory(fresh_pool, "q2", dram_bytes=q_dram, ssd_bytes=q_ssd, replicas=2)
    _wait_shares(c, 2)
    _fill(c, "x-", 60)  # 6 MB of objects into a 3 MB (SSD) namespace
    usage = _ns_usage(c, "q2")
    assert all(d <= q_dram and s <= q_ssd for d, s in usage.values()), usage
    assert all(s > q_ssd // 2 + (200 << 10) for _, s in usage.values()), usage  # more than a half share
