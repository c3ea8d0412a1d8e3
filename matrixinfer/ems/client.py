"""EMS client library (sync): put/get/exists/delete and batches, per namespace.

The client pulls the ring view from the controller and talks to MP servers directly. A server
that is down or slow costs a miss (get -> None, put -> False), never an exception: callers
are serving requests and a cache must not fail them. Bad input raises EMSError.

Replicas: a namespace with `replicas: N` has each key written to its N holders on the ring
(view.owners) in parallel, a put is True once all of them acknowledged; reads ask the holders
in ring order until one has it, so a dead holder costs a failed connection, not a miss.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .config import ClientConfig
from .protocol import (Connection, EMSError, as_buffer, call_once, decode_get_reply, drain, ns_create_header, parse_addr,
                       recv_exact_into, wire_key)
from .samehost import SameHost
from .view import ClusterView, FirstHolder, Member, by_server, fold

NET_ERRORS = (OSError, ConnectionError, TimeoutError)


class _Server:
    """Client-side handle of one MP server: its connection and (same host) its memory."""

    def __init__(self, m: Member, cfg: ClientConfig):
        self.member = m
        self.conn = Connection((m.host, m.port), cfg.timeout_s)
        self.local = SameHost.open(m, cfg.zero_copy)
        self.down_until = 0.0

    def arena(self):
        """The same-host arena reader, if the server is not backed off or dead."""
        if self.local is None or self.down_until > time.monotonic():
            return None
        return self.local.arena()

    def close(self) -> None:
        self.conn.close()
        if self.local:
            self.local.close()


class EMSClient:
    def __init__(self, controller: str, namespace: str = "default", *, zero_copy: bool = True,
                 timeout_s: float = 5.0, dram_bytes: int | None = None, ssd_bytes: int | None = None,
                 replicas: int | None = None):
        self.cfg = ClientConfig(controller=controller, namespace=namespace, zero_copy=zero_copy, timeout_s=timeout_s)
        parse_addr(controller)
        self.ns = namespace
        self._lock = threading.Lock()
        self._servers: dict[str, _Server] = {}
        self.view = ClusterView()
        self.replicas = 1  # the namespace's, from the controller at every view refresh
        self._view_at = 0.0
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ems-client")
        # Namespaces are created on first use; explicit quotas or replicas (re)define them.
        implicit = dram_bytes is None and ssd_bytes is None and replicas is None
        self.create_namespace(namespace, dram_bytes, ssd_bytes, if_absent=implicit, replicas=replicas)
        self.refresh_view(force=True)

    # -- controller --------------------------------------------------------------------------------
    def create_namespace(self, name: str, dram_bytes: int | None = None, ssd_bytes: int | None = None,
                         if_absent: bool = False, replicas: int | None = None) -> bool:
        """Create (or, without `if_absent`, redefine) a namespace: pool-wide quotas and the
        number of copies of each object (`replicas`, default 1). True if it was (re)defined."""
        header = ns_create_header(name, dram_bytes, ssd_bytes, replicas, if_absent)
        reply = call_once(self.cfg.controller, header, self.cfg.timeout_s)
        if name == self.ns:
            self.replicas = reply.get("replicas", 1)
        return reply["created"]

    def refresh_view(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._view_at < self.cfg.view_refresh_s:
            return
        self._view_at = now
        try:
            reply = call_once(self.cfg.controller, {"op": "view", "ns": self.ns}, self.cfg.timeout_s)
        except NET_ERRORS:
            return  # controller unreachable: keep serving with the last view
        self.replicas = reply.get("replicas", 1)
        with self._lock:
            if reply["version"] == self.view.version:
                return
            self.view = ClusterView.from_reply(reply)
            for sid in list(self._servers):
                if sid not in self.view.members or self._servers[sid].member != self.view.members[sid]:
                    self._servers.pop(sid).close()

    def _server(self, sid: str) -> _Server | None:
        with self._lock:
            s = self._servers.get(sid)
            if s is None and sid in self.view.members:
                s = self._servers[sid] = _Server(self.view.members[sid], self.cfg)
            return s

    def _call(self, sid: str | None, header: dict, buffers=(), into=None):
        """One request to one server; None if it is unreachable (the caller treats it as a miss)."""
        s = self._server(sid) if sid else None
        if s is None or s.down_until > time.monotonic():
            return None
        try:
            return s.conn.call({**header, "ns": self.ns}, buffers, into)
        except NET_ERRORS:
            s.down_until = time.monotonic() + self.cfg.down_backoff_s
            self._view_at = 0.0  # membership probably changed: look again on the next call
            return None

    def holders(self, key: str) -> list[str]:
        """The servers that hold `key` (wire form) in this client's view, in read order."""
        return self.view.owners(self.ns, key, self.replicas)

    def _each(self, groups: dict[str, list[int]], fn) -> list[tuple[list[int], list]]:
        """Run fn(server_id, indices) -> per-index values for each server in parallel."""
        if len(groups) <= 1:
            return [(idx, fn(sid, idx)) for sid, idx in groups.items()]
        futures = [(idx, self._pool.submit(fn, sid, idx)) for sid, idx in groups.items()]
        return [(idx, f.result()) for idx, f in futures]

    def _all_holders(self, keys: list[str], fn, combine) -> list[bool]:
        """fn on every holder of every key (writes, exists, deletes), folded per key with
        `combine` (all: stored everywhere; any: found somewhere)."""
        self.refresh_view()
        return fold(len(keys), self._each(by_server([self.holders(k) for k in keys]), fn), combine)

    def _first_holder(self, keys: list[str], fn) -> list:
        """fn on each key's first holder, then the misses on the next holders (a dead or
        replaced holder's keys are read from another copy): the values in key order."""
        self.refresh_view()
        read = FirstHolder([self.holders(k) for k in keys])
        while groups := read.round():
            read.merge(self._each(groups, fn))
        return read.values

    # -- single-key API ---------------------------------------------------------------------------
    def put(self, key: str | bytes, value) -> bool:
        """Store value (bytes or any buffer, e.g. a CPU tensor); True once durable on every
        holder (its server, or the namespace's N replica servers)."""
        k, buf = wire_key(key), as_buffer(value)

        def one(sid, idx):
            return [self._call(sid, {"op": "put", "key": k}, [buf]) is not None]

        return self._all_holders([k], one, all)[0]

    def get(self, key: str | bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_into(self, key: str | bytes, out) -> int | None:
        """Copy the value straight into a writable buffer (e.g. a tensor): one copy, from the
        server's arena (same host) or the socket. Returns the value's length, or None on a miss."""
        k, dst = wire_key(key), as_buffer(out)
        if dst.readonly:
            raise EMSError("get_into needs a writable buffer")
        return self._first_holder([k], lambda sid, idx: [self._get_into_from(sid, k, dst)])[0]

    def _get_into_from(self, sid: str, k: str, dst: memoryview) -> int | None:
        s = self._server(sid)
        reader = s.arena() if s is not None else None
        if reader is not None:
            n = s.local.get_into(self.ns, k, dst)
            if n is not None:
                self._hit(sid, s, [k])
                return n
            r = self._call(sid, {"op": "get", "key": k, "shm": True})
            if r is None:
                return None
            loc, n = r[0]["loc"], r[0]["len"]
            if loc is None and n < 0:
                return None
            if loc is not None:
                if loc[1] > len(dst):
                    raise EMSError(f"buffer of {len(dst)} bytes too small for a {loc[1]}-byte value")
                if reader.read_into(loc[0], loc[2], loc[1], loc[3], dst):
                    return loc[1]
            # replaced under us or not in DRAM: fall through to the TCP path

        def into(reply, plen, sock):
            if plen > len(dst):
                drain(sock, plen)
                return -plen
            recv_exact_into(sock, dst[:plen])
            return plen

        r = self._call(sid, {"op": "get", "key": k, "shm": False}, into=into)
        if r is None or r[0]["len"] < 0:
            return None
        if r[1] < 0:
            raise EMSError(f"buffer of {len(dst)} bytes too small for a {-r[1]}-byte value")
        return r[1]

    def exists(self, keys) -> list[bool] | bool:
        single = isinstance(keys, (str, bytes))
        ks = [wire_key(k) for k in ([keys] if single else keys)]

        def one(sid, idx):
            r = self._call(sid, {"op": "exists", "keys": [ks[i] for i in idx]})
            return r[0]["found"] if r else [False] * len(idx)

        out = self._all_holders(ks, one, any)
        return out[0] if single else out

    def delete(self, key: str | bytes) -> bool:
        k = wire_key(key)

        def one(sid, idx):
            r = self._call(sid, {"op": "delete", "key": k})
            return [bool(r and r[0]["deleted"])]

        return self._all_holders([k], one, any)[0]

    def lease(self, key: str | bytes, ttl_s: float = 30.0) -> bool | None:
        """True if the caller should fill this absent key (the others wait for it until it
        appears or the lease expires); None if its server is unreachable."""
        k = wire_key(key)
        self.refresh_view()
        for sid in self.holders(k):  # the first live holder arbitrates
            r = self._call(sid, {"op": "lease", "key": k, "ttl_s": ttl_s})
            if r is not None:
                return bool(r[0]["acquired"])
        return None

    # -- batches ----------------------------------------------------------------------------------
    def put_many(self, items) -> list[bool]:
        """items: dict or (key, value) pairs; one request per server, all servers in parallel."""
        pairs = list(items.items() if isinstance(items, dict) else items)
        ks = [wire_key(k) for k, _ in pairs]
        bufs = [as_buffer(v) for _, v in pairs]

        def one(sid, idx):
            r = self._call(sid, {"op": "put_many", "keys": [ks[i] for i in idx], "lens": [len(bufs[i]) for i in idx]}, [bufs[i] for i in idx])
            return r[0]["stored"] if r else [False] * len(idx)

        return self._all_holders(ks, one, all)

    def get_many(self, keys) -> list[bytes | None]:
        ks = [wire_key(k) for k in keys]
        return self._first_holder(ks, lambda sid, idx: self._get_group(sid, [ks[i] for i in idx]))

    def _hit(self, sid: str, s: _Server, keys: list[str]) -> None:
        """Report reads served from shared memory to the server's LRU, in batches."""
        batch = s.local.hit(keys)
        if batch:
            self._call(sid, {"op": "touch", "keys": batch})

    def _get_group(self, sid: str, keys: list[str]) -> list[bytes | None]:
        s = self._server(sid)
        values: list[bytes | None] = [None] * len(keys)
        need = list(range(len(keys)))
        reader = s.arena() if s is not None else None
        if reader is not None:
            # Same host: find the value through the server's shared index and copy it out
            # of its arena, no round trip; anything not found or changed goes over RPC.
            need, hits = [], []
            for i, k in enumerate(keys):
                v = s.local.get(self.ns, k)
                if v is None:
                    need.append(i)
                else:
                    values[i] = v
                    hits.append(k)
            if hits:
                self._hit(sid, s, hits)
            if not need:
                return values
        for shm in ((True, False) if reader is not None else (False,)):
            r = self._call(sid, {"op": "get_many", "keys": [keys[i] for i in need], "shm": shm})
            if r is None:
                return values
            retry = []
            for i, (view, loc) in zip(need, decode_get_reply(*r)):
                if view is not None:
                    values[i] = bytes(view)
                elif loc is not None:
                    values[i] = reader.read_bytes(loc[0], loc[2], loc[1], loc[3])
                    if values[i] is None:
                        retry.append(i)  # evicted or replaced while we copied: ask over TCP
            need = retry
            if not need:
                break
        return values

    # -- admin ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, dict]:
        self.refresh_view(force=True)
        out = {}
        for sid in self.view.members:
            r = self._call(sid, {"op": "stats"})
            if r is not None:
                out[sid] = r[0]
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            for s in self._servers.values():
                s.close()
            self._servers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
