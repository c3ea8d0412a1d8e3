"""The controller's state (namespaces, quotas, ring version) across controller restarts, the
order of namespace creation, and quota shares as servers join and leave (real processes)."""

import os
import time

import pytest

from matrixinfer.ems.protocol import call_once


def _ns_usage(client, ns):
    """Per server: (DRAM bytes, SSD bytes) the namespace holds there."""
    return {sid: (s["ns_dram_bytes"].get(ns, 0), s["ns_ssd_bytes"].get(ns, 0)) for sid, s in client.stats().items()}


def _wait_shares(client, n, timeout_s=10.0):
    """Until every server has heard that the pool has n servers (at its next heartbeat)."""
    deadline = time.monotonic() + timeout_s
    client.refresh_view(force=True)
    while sorted(s["n_servers"] for s in client.stats().values()) != [n] * n:
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.05)


def _fill(client, prefix, n, size=100_000):
    """Put n values one by one (a batch larger than a DRAM share cannot be pending at once)."""
    assert all([client.put(f"{prefix}{i}", os.urandom(size)) for i in range(n)])


@pytest.mark.pool(n_servers=2, dram_bytes=8 << 20)
def test_quotas_survive_a_controller_kill9_and_restart(fresh_pool, client_factory):
    """Quotas hold while the controller is dead (servers keep what they last heard) and after
    it restarts from its SQLite file (it does not hand the servers an empty table); the ring
    version only goes up."""
    c = client_factory(fresh_pool, "small", dram_bytes=1 << 20, ssd_bytes=2 << 20)
    _wait_shares(c, 2)
    share = (1 << 20) // 2, (2 << 20) // 2
    version = call_once(fresh_pool.controller, {"op": "view"})["version"]
    fresh_pool.restart_controller()  # SIGKILL, then the same port
    time.sleep(1.0)  # a few heartbeats: the servers have heard from the new controller
    assert call_once(fresh_pool.controller, {"op": "view"})["version"] > version
    ns = call_once(fresh_pool.controller, {"op": "ns_list"})["namespaces"]
    assert (ns["small"]["dram_bytes"], ns["small"]["ssd_bytes"]) == (1 << 20, 2 << 20)
    _fill(c, "after-", 60)  # 6 MB into a 2 MB namespace
    usage = _ns_usage(c, "small")
    assert len(usage) == 2 and all(d <= share[0] and s <= share[1] for d, s in usage.values()), usage
    fresh_pool.ctl.popen.kill()  # and while it is away
    fresh_pool.ctl.popen.wait(10)
    _fill(c, "away-", 60)
    usage = _ns_usage(c, "small")
    assert all(d <= share[0] and s <= share[1] for d, s in usage.values()), usage


def test_namespace_creation_order_does_not_matter(pool, client_factory):
    """A client's implicit creation (no quota) then an explicit quota, or the other way
    round: either way the namespace ends up with the quota."""
    ns = lambda name: call_once(pool.controller, {"op": "ns_list"})["namespaces"][name]  # noqa: E731
    first = client_factory(pool, "implicit-first")
    assert ns("implicit-first")["dram_bytes"] > 1 << 50  # unlimited until a quota is given
    assert first.create_namespace("implicit-first", dram_bytes=1 << 20, ssd_bytes=4 << 20, if_absent=True)
    assert (ns("implicit-first")["dram_bytes"], ns("implicit-first")["ssd_bytes"]) == (1 << 20, 4 << 20)
    client_factory(pool, "explicit-first", dram_bytes=2 << 20, ssd_bytes=8 << 20)
    later = client_factory(pool, "explicit-first")  # implicit: leaves the quota alone
    assert not later.create_namespace("explicit-first", if_absent=True)
    assert (ns("explicit-first")["dram_bytes"], ns("explicit-first")["ssd_bytes"]) == (2 << 20, 8 << 20)
    assert not later.create_namespace("explicit-first", dram_bytes=1, ssd_bytes=1, if_absent=True)


@pytest.mark.pool(n_servers=2, dram_bytes=8 << 20)
def test_quota_shares_follow_servers_joining_and_leaving(fresh_pool, client_factory):
    """Each server enforces quota / number of servers: with 2, then 3 (a join shrinks every
    share at once), then 2 again (a clean leave), no server holds more than its share and
    the namespace never holds more than its quota in total."""
    q_dram, q_ssd = 3 << 20, 6 << 20
    c = client_factory(fresh_pool, "shared", dram_bytes=q_dram, ssd_bytes=q_ssd)

    def check(n):
        usage = _ns_usage(c, "shared")
        assert len(usage) == n
        assert all(d <= q_dram // n and s <= q_ssd // n for d, s in usage.values()), (n, usage)
        assert sum(s for _, s in usage.values()) <= q_ssd

    _wait_shares(c, 2)
    _fill(c, "two-", 100)  # 10 MB into 6 MB
    check(2)
    fresh_pool.add_server()
    _wait_shares(c, 3)  # the old servers learn of the third at their next heartbeat...
    check(3)  # ...and shrink to their new share at once
    _fill(c, "three-", 100)
    check(3)
    fresh_pool.kill_server(2, sig=15)  # a clean leave: the controller drops it at once
    fresh_pool.wait_members(2)
    _wait_shares(c, 2)
    _fill(c, "two-again-", 100)
    check(2)
