"""What the MP server leaves behind: a clean exit on SIGTERM (requests in flight finish, the
log is flushed), no arena of a dead server in /dev/shm, and where the arena's pages live
(huge pages, NUMA node) with a clean fallback."""

import fcntl
import glob
import os
import threading
import time

import pytest

from matrixinfer.ems import placement
from matrixinfer.ems.arena import Arena, reap_dead_arenas
from matrixinfer.ems.protocol import call_once


@pytest.mark.pool(n_servers=1, dram_bytes=16 << 20)
def test_sigterm_finishes_puts_in_flight_flushes_and_exits_0(fresh_pool, client_factory):
    """Puts run in a loop while the server gets SIGTERM: it exits 0, no put raises, the
    controller drops it at once (it says it leaves), its arena is gone from /dev/shm, and
    every put it acknowledged is there after a restart."""
    c = client_factory(fresh_pool, "term")
    acked, errors, stop = [], [], threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            try:
                if c.put(f"k{i}", bytes([i % 251]) * 50_000):
                    acked.append(i)
            except Exception as e:  # the property under test: nothing escapes
                errors.append(repr(e))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 20:
        time.sleep(0.01)
    sid = fresh_pool.servers[0].id
    fresh_pool.servers[0].popen.terminate()
    assert fresh_pool.servers[0].popen.wait(15) == 0
    assert fresh_pool.members() == []  # no heartbeat timeout needed
    time.sleep(0.1)
    stop.set()
    t.join(30)
    assert errors == [] and not glob.glob(f"/dev/shm/mi-ems-{sid}-*")
    fresh_pool.restart_server(0)
    after = client_factory(fresh_pool, "term")
    assert after.get_many([f"k{i}" for i in acked]) == [bytes([i % 251]) * 50_000 for i in acked]
    fresh_pool.ctl.popen.terminate()
    assert fresh_pool.ctl.popen.wait(15) == 0


@pytest.mark.pool(n_servers=2)
def test_a_starting_server_reaps_the_arena_of_a_server_killed_for_good(fresh_pool):
    """A server SIGKILLed and never restarted leaves its arena in /dev/shm; the next server to
    start (any id) removes it, and leaves live servers' arenas alone."""
    dead, live = fresh_pool.servers[1].id, fresh_pool.servers[0].id
    fresh_pool.kill_server(1)
    assert len(glob.glob(f"/dev/shm/mi-ems-{dead}-*")) == 2  # arena and index
    fresh_pool.add_server()
    assert glob.glob(f"/dev/shm/mi-ems-{dead}-*") == []
    assert len(glob.glob(f"/dev/shm/mi-ems-{live}-*")) == 2


def test_reaper_tells_dead_arenas_by_their_lock(tmp_path):
    """Unlocked and old, or of a dead pid: removed with its index. Locked (a live server), or
    just created by a live process that has not locked it yet: kept. An index without its
    arena: removed."""
    def arena(name, age_s=0.0):
        path = tmp_path / name
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age_s,) * 2)
        (tmp_path / (name + ".idx")).write_bytes(b"i")
        return path

    me = os.getpid()
    old_unlocked = arena(f"mi-ems-a-{me}", age_s=3600)
    dead_pid = arena("mi-ems-b-999999999")
    creating = arena(f"mi-ems-c-{me}")
    held = arena("mi-ems-d-999999998", age_s=3600)
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (tmp_path / "mi-ems-e-1.idx").write_bytes(b"orphan")
    try:
        reap_dead_arenas(str(tmp_path))
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted([creating.name, creating.name + ".idx", held.name, held.name + ".idx"])
    assert not old_unlocked.exists() and not dead_pid.exists()


def test_arena_placement_falls_back_cleanly(tmp_path):
    """auto: the arena works whatever the machine allows and reports how many of its bytes
    are huge pages; on: an error that says why where none can be had; off: no advice."""
    path = "/dev/shm/mi-ems-test-placement-" + str(os.getpid())
    a = Arena(4 << 20, path, huge_pages="auto", numa_node="auto")
    try:
        assert a.placement["huge_pages_advised"] and a.huge_page_bytes() >= 0
        assert a.placement["numa_node"] is None or len(placement.numa_nodes()) > 1
        off = a.allocate(100)
        a.data(off, 100)[:] = b"y" * 100
    finally:
        a.close()
    b = Arena(4 << 20, path, huge_pages="off", numa_node="off")
    assert b.placement == {"huge_pages_advised": False, "numa_node": None, "hugetlbfs": False}
    b.close()
    if placement.hugetlbfs_dir(4 << 20) is None and "[never]" in open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read():
        with pytest.raises(OSError, match="huge page"):
            Arena(4 << 20, path, huge_pages="on")
    assert not os.path.exists(path)


def test_arena_pages_prefer_the_numa_node_asked_for():
    """An explicit node is applied with mbind before the pages are faulted in (node 0 exists
    everywhere): /proc/self/numa_maps shows the preference on the arena's mapping."""
    path = "/dev/shm/mi-ems-test-numa-" + str(os.getpid())
    a = Arena(1 << 20, path, huge_pages="off", numa_node=0)
    try:
        with open("/proc/self/numa_maps") as f:
            line = next(ln for ln in f if ln.rstrip().endswith(path) or f"file={path}" in ln)
        if placement.SYS_MBIND is not None:
            assert a.placement["numa_node"] == 0 and "prefer:0" in line
    finally:
        a.close()
