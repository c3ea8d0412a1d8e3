"""Put/get through real MP server processes: paths, buffers, namespaces, quotas, bad input."""

import os
import time

import numpy as np
import pytest
import torch

from matrixinfer.ems import EMSClient, EMSError


def test_roundtrip_over_shared_memory_and_tcp(pool, client_factory):
    """Values of 0 B..4 MiB come back byte-exact on the same-host (shm) path and the TCP path."""
    shm, tcp = client_factory(pool, "rt"), client_factory(pool, "rt", zero_copy=False)
    assert all(shm._server(i).local is not None for i in shm.view.members)
    vals = {f"v{n}": os.urandom(n) for n in (0, 1, 100, 65536, 1 << 20, 4 << 20)}
    assert shm.put_many(vals) == [True] * len(vals)
    for c in (shm, tcp):
        assert c.get_many(list(vals)) == list(vals.values())
        assert all(c.get(k) == v for k, v in vals.items())


def test_batches_reach_every_server(pool, client_factory):
    """put_many/get_many spread keys over both servers and return results in key order."""
    c = client_factory(pool, "batch")
    vals = {f"b{i}": os.urandom(1000 + i) for i in range(64)}
    assert all(c.put_many(vals))
    assert c.get_many([*vals, "absent"]) == [*vals.values(), None]
    owners = {c.view.owner("batch", k) for k in vals}
    assert len(owners) == 2
    counts = [s["counters"]["puts"] for s in c.stats().values()]
    assert all(n > 0 for n in counts)


def test_buffer_protocol_values_are_stored_without_conversion(pool, client_factory):
    """Tensors and numpy arrays are stored from their buffers; get_into fills a tensor in place."""
    c = client_factory(pool, "buf")
    t = torch.arange(1000, dtype=torch.float32)
    a = np.arange(500, dtype=np.int16)
    assert c.put("tensor", t) and c.put("array", a)
    out = torch.empty(1000, dtype=torch.float32)
    assert c.get_into("tensor", out) == 4000 and torch.equal(out, t)
    assert np.array_equal(np.frombuffer(c.get("array"), dtype=np.int16), a)


def test_overwrite_replaces_and_delete_removes(pool, client_factory):
    """A second put of a key is what get returns; after delete, exists is False and get None."""
    c = client_factory(pool, "ow")
    c.put("k", b"one")
    c.put("k", b"two")
    assert c.get("k") == b"two"
    assert c.exists(["k", "nope"]) == [True, False]
    assert c.delete("k") and c.get("k") is None and c.exists("k") is False
    assert c.delete("k") is False


def test_namespaces_are_isolated(pool, client_factory):
    """The same key in two namespaces holds two values; deleting one leaves the other."""
    a, b = client_factory(pool, "tenant-a"), client_factory(pool, "tenant-b")
    a.put("shared-name", b"A")
    assert b.get("shared-name") is None and b.exists(["shared-name"]) == [False]
    b.put("shared-name", b"B")
    a.delete("shared-name")
    assert a.get("shared-name") is None and b.get("shared-name") == b"B"


def test_str_and_bytes_keys_name_the_same_object(pool, client_factory):
    """Keys are bytes on the wire: 'k' and b'k' are one key; non-UTF-8 bytes keys work."""
    c = client_factory(pool, "keys")
    c.put("ké", b"1")
    assert c.get("ké".encode()) == b"1"
    c.put(b"\xff\x00raw", b"2")
    assert c.get(b"\xff\x00raw") == b"2"


def test_bad_input_raises_clear_errors(pool, client_factory):
    """Wrong types and impossible sizes raise EMSError naming the problem."""
    c = client_factory(pool, "bad")
    with pytest.raises(EMSError, match="buffer protocol"):
        c.put("k", 12)
    with pytest.raises(EMSError, match="key must"):
        c.put(3, b"x")
    with pytest.raises(EMSError, match="empty"):
        c.get("")
    with pytest.raises(EMSError, match="does not fit"):
        c.put("huge", bytearray(40 << 20))  # arena is 32 MiB
    with pytest.raises(EMSError, match="HOST:PORT"):
        EMSClient("localhost", "x")
    with pytest.raises(EMSError, match="positive"):
        c.create_namespace("q", dram_bytes=-1)


@pytest.mark.pool(n_servers=1, dram_bytes=8 << 20)
def test_namespace_quota_evicts_only_inside_that_namespace(fresh_pool, client_factory):
    """A tenant over its DRAM share evicts its own LRU objects (still on SSD); over its SSD
    share it loses its own oldest objects; the other tenant keeps everything."""
    small = client_factory(fresh_pool, "small", dram_bytes=1 << 20, ssd_bytes=2 << 20)
    other = client_factory(fresh_pool, "other")
    theirs = {f"o{i}": os.urandom(100_000) for i in range(20)}
    assert all(other.put_many(theirs))
    mine = {f"s{i}": os.urandom(200_000) for i in range(20)}  # 4 MB > 2 MB SSD > 1 MB DRAM
    for k, v in mine.items():
        assert small.put(k, v)
    st = next(iter(small.stats().values()))
    assert st["ns_dram_bytes"]["small"] <= 1 << 20
    assert st["ns_ssd_bytes"]["small"] <= 2 << 20
    assert st["counters"]["evictions_dram"] > 0 and st["counters"]["evictions_ssd"] > 0
    got = small.get_many(list(mine))
    assert got[0] is None and got[-1] == mine["s19"]  # oldest gone, newest kept
    assert all(g is None or g == mine[k] for g, k in zip(got, mine))
    assert other.get_many(list(theirs)) == list(theirs.values())
    with pytest.raises(EMSError, match="SSD share"):
        small.put("too-big-for-ssd", bytearray(3 << 20))


@pytest.mark.pool(n_servers=1, dram_bytes=2 << 20)
def test_dram_eviction_falls_back_to_ssd_and_promotes(fresh_pool, client_factory):
    """Writing 4x the arena keeps every value readable: evicted ones come back from SSD."""
    c = client_factory(fresh_pool, "spill")
    vals = {f"k{i}": os.urandom(256_000) for i in range(32)}
    assert all(c.put(k, v) for k, v in vals.items())
    assert c.get_many(list(vals)) == list(vals.values())
    n = next(iter(c.stats().values()))["counters"]
    assert n["evictions_dram"] > 0 and n["hits_ssd"] > 0


def test_same_host_reads_need_no_request_to_the_server(pool, client_factory):
    """Values in DRAM are found through the server's shared index and copied out of its arena:
    a same-host get/get_many/get_into sends no get request (TCP clients do)."""
    c = client_factory(pool, "zc")
    vals = {f"z{i}": os.urandom(70_000) for i in range(20)}
    assert all(c.put_many(vals))
    sent = []
    real_call = c._call
    c._call = lambda sid, header, *a, **kw: (sent.append(header["op"]), real_call(sid, header, *a, **kw))[1]
    out = bytearray(70_000)
    assert c.get_many(list(vals)) == list(vals.values())
    assert c.get("z3") == vals["z3"] and c.get_into("z4", out) == 70_000 and out == vals["z4"]
    assert not {"get", "get_many"} & set(sent)
    tcp = client_factory(pool, "zc", zero_copy=False)
    tcp_sent = []
    real_tcp = tcp._call
    tcp._call = lambda sid, header, *a, **kw: (tcp_sent.append(header["op"]), real_tcp(sid, header, *a, **kw))[1]
    assert tcp.get("z3") == vals["z3"] and tcp_sent == ["get_many"]


@pytest.mark.pool(n_servers=1, dram_bytes=2 << 20)
def test_shared_memory_hits_keep_a_value_hot_in_the_lru(fresh_pool, client_factory, monkeypatch):
    """Reads served from shared memory are reported to the server, so the value read most
    recently survives DRAM eviction while colder ones are evicted."""
    import matrixinfer.ems.samehost as samehost

    monkeypatch.setattr(samehost, "TOUCH_BATCH", 1)  # report every hit at once
    c = client_factory(fresh_pool, "lru")
    for i in range(6):
        c.put(f"k{i}", os.urandom(250_000))
    assert c.get("k0") is not None  # k0 is now the most recently used
    for i in range(6, 9):
        c.put(f"k{i}", os.urandom(250_000))
    local = c._server(next(iter(c.view.members))).local
    assert local.locate("lru", "k0") is not None  # still in DRAM
    assert local.locate("lru", "k1") is None  # evicted (its bytes remain on SSD)
    assert c.get("k1") is not None


def test_a_put_cut_off_midway_is_never_visible_and_frees_its_space(pool, client_factory):
    """Two-phase put: a client that dies after sending half a value leaves no object behind
    (not readable, not on SSD) and its pending arena block is returned."""
    import socket

    from matrixinfer.ems.protocol import encode_prefix

    c = client_factory(pool, "half")
    sid = c.view.owner("half", "torn")
    before = c.stats()[sid]["arena"]["used_bytes"]
    m = c.view.members[sid]
    with socket.create_connection((m.host, m.port)) as s:
        s.sendall(encode_prefix({"op": "put", "ns": "half", "key": "torn"}, 1 << 20) + b"x" * (1 << 19))
    time.sleep(0.2)
    assert c.get("torn") is None and c.exists(["torn"]) == [False]
    st = c.stats()[sid]
    assert st["arena"]["used_bytes"] == before and "half" not in st["ns_ssd_bytes"]


def test_garbage_on_the_wire_closes_that_connection_only(pool, client_factory):
    """Bytes that are not a frame make the server drop that connection; it keeps serving."""
    import socket

    c = client_factory(pool, "garbage")
    c.put("k", b"v")
    for m in c.view.members.values():
        with socket.create_connection((m.host, m.port)) as s:
            s.sendall(b"\xff" * 12 + b"not json at all")
            s.settimeout(2)
            try:
                assert s.recv(100) == b""  # closed by the server...
            except ConnectionResetError:
                pass  # ...or reset, as unread garbage was still queued
    assert c.get("k") == b"v"
