"""The controller's view reaches running clients (real processes, no client or controller
restart, no forced refresh): servers that join, die and return, and a controller restart."""

import asyncio
import time

import pytest

from matrixinfer.ems import AsyncEMSClient
from matrixinfer.ems.protocol import call_once
from tests.ems.test_failures import value_for

pytestmark = pytest.mark.timeout(60)


def _until(client, pred, timeout_s=10.0):
    """Keep the client working (one get every 0.1 s: its only chance to refresh) until pred()."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, sorted(client.view.members)
        client.get("probe")
        time.sleep(0.1)


@pytest.mark.pool(n_servers=2, dram_bytes=16 << 20, heartbeat_timeout_s=1.0)
def test_a_running_client_follows_a_join_a_death_and_a_return(fresh_pool, client_factory):
    """A server that joins gets the client's next puts; one SIGKILLed leaves its view; the same
    server restarted (new port) is back in it and serves what it held."""
    c = client_factory(fresh_pool, "follow")
    i = fresh_pool.add_server()
    new = fresh_pool.servers[i].id
    _until(c, lambda: new in c.view.members)
    keys = [f"f-{j}" for j in range(120)]
    assert all(c.put_many([(k, value_for(k, 2000)) for k in keys]))
    on_new = [k for k in keys if c.holders(k) == [new]]
    assert on_new and c.stats()[new]["counters"]["puts"] == len(on_new)
    fresh_pool.kill_server(i)
    _until(c, lambda: new not in c.view.members)
    fresh_pool.restart_server(i)
    port = int(fresh_pool.servers[i].addr.rsplit(":", 1)[1])
    _until(c, lambda: new in c.view.members and c.view.members[new].port == port)
    assert c.get_many(on_new) == [value_for(k, 2000) for k in on_new]


@pytest.mark.pool(n_servers=2, dram_bytes=16 << 20, heartbeat_timeout_s=1.0)
def test_clients_outlive_a_controller_kill9_and_see_servers_added_after_it(fresh_pool, client_factory):
    """The controller is SIGKILLed and restarted: namespaces, quotas, replicas and the ring are
    as before; a server added afterwards reaches the sync and the async client that were
    running all along, and their replicated keys keep hitting."""
    c = client_factory(fresh_pool, "outlive", dram_bytes=8 << 20, replicas=2)
    keys = [f"o-{j}" for j in range(60)]
    assert all(c.put_many([(k, value_for(k, 2000)) for k in keys]))
    ring = sorted(c.view.members)

    async def scenario():
        ac = await AsyncEMSClient.connect(fresh_pool.controller, "outlive")
        try:
            fresh_pool.restart_controller()  # SIGKILL, then the same port
            ns = call_once(fresh_pool.controller, {"op": "ns_list"})["namespaces"]["outlive"]
            assert (ns["dram_bytes"], ns["replicas"]) == (8 << 20, 2)
            assert sorted(m["id"] for m in call_once(fresh_pool.controller, {"op": "view"})["servers"]) == ring
            new = fresh_pool.servers[fresh_pool.add_server()].id
            deadline = time.monotonic() + 10
            while new not in ac.view.members:
                assert time.monotonic() < deadline, sorted(ac.view.members)
                assert await ac.get_many(keys) == [value_for(k, 2000) for k in keys]
                await asyncio.sleep(0.1)
            assert ac.replicas == 2
            return new
        finally:
            await ac.close()

    new = asyncio.run(scenario())
    _until(c, lambda: new in c.view.members)
    assert c.replicas == 2 and c.get_many(keys) == [value_for(k, 2000) for k in keys]
    assert all(c.put_many([(f"n-{j}", b"x" * 100) for j in range(60)]))
    assert c.stats()[new]["counters"]["puts"] > 0
