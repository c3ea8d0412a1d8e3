"""EMS client library (sync): put/get/exists/delete and batches, per namespace.

The client pulls the ring view from the controller and talks to MP servers directly. A server
that is down or slow costs a miss (get -> None, put -> False), never an exception: callers
are serving requests and a cache must not fail them. Bad input raises EMSError.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .config import ClientConfig
from .protocol import Connection, EMSError, as_buffer, call_once, decode_get_reply, drain, parse_addr, recv_exact_into, wire_key
from .samehost import SameHost
from .view import ClusterView, Member, scatter

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
                 timeout_s: float = 5.0, dram_bytes: int | None = None, ssd_bytes: int | None = None):
        self.cfg = ClientConfig(controller=controller, namespace=namespace, zero_copy=zero_copy, timeout_s=timeout_s)
        parse_addr(controller)
        self.ns = namespace
        self._lock = threading.Lock()
        self._servers: dict[str, _Server] = {}
        self.view = ClusterView()
        self._view_at = 0.0
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ems-client")
        # Namespaces are created on first use; explicit quotas (re)define them.
        self.create_namespace(namespace, dram_bytes, ssd_bytes, if_absent=dram_bytes is None and ssd_bytes is None)
        self.refresh_view(force=True)

    # -- controller --------------------------------------------------------------------------------
    def create_namespace(self, name: str, dram_bytes: int | None = None, ssd_bytes: int | None = None, if_absent: bool = False) -> bool:
        reply = call_once(self.cfg.controller, {"op": "ns_create", "name": name, "dram_bytes": dram_bytes, "ssd_bytes": ssd_bytes, "if_absent": if_absent}, self.cfg.timeout_s)
        return reply["created"]

    def refresh_view(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._view_at < self.cfg.view_refresh_s:
            return
        self._view_at = now
        try:
            reply = call_once(self.cfg.controller, {"op": "view"}, self.cfg.timeout_s)
        except NET_ERRORS:
            return  # controller unreachable: keep serving with the last view
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

    def _fanout(self, keys: list[str], fn, fill) -> list:
        """Run fn(server_id, indices) -> values for each owning server in parallel; the values
        in key order (`fill` where a server had nothing to say)."""
        self.refresh_view()
        groups = self.view.route(self.ns, keys)
        if len(groups) == 1:
            (sid, idx), = groups.items()
            return scatter(len(keys), [(idx, fn(sid, idx))], fill)
        futures = [(idx, self._pool.submit(fn, sid, idx)) for sid, idx in groups.items()]
        return scatter(len(keys), [(idx, f.result()) for idx, f in futures], fill)

    # -- single-key API ---------------------------------------------------------------------------
    def put(self, key: str | bytes, value) -> bool:
        """Store value (bytes or any buffer, e.g. a CPU tensor); True once durable on its server."""
        k, buf = wire_key(key), as_buffer(value)
        self.refresh_view()
        reply = self._call(self.view.owner(self.ns, k), {"op": "put", "key": k}, [buf])
        return reply is not None

    def get(self, key: str | bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_into(self, key: str | bytes, out) -> int | None:
        """Copy the value straight into a writable buffer (e.g. a tensor): one copy, from the
        server's arena (same host) or the socket. Returns the value's length, or None on a miss."""
        k, dst = wire_key(key), as_buffer(out)
        if dst.readonly:
            raise EMSError("get_into needs a writable buffer")
        self.refresh_view()
        sid = self.view.owner(self.ns, k)
        s = self._server(sid) if sid else None
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

        out = self._fanout(ks, one, False)
        return out[0] if single else out

    def delete(self, key: str | bytes) -> bool:
        k = wire_key(key)
        self.refresh_view()
        r = self._call(self.view.owner(self.ns, k), {"op": "delete", "key": k})
        return bool(r and r[0]["deleted"])

    def lease(self, key: str | bytes, ttl_s: float = 30.0) -> bool | None:
        """True if the caller should fill this absent key (the others wait for it until it
        appears or the lease expires); None if its server is unreachable."""
        k = wire_key(key)
        self.refresh_view()
        r = self._call(self.view.owner(self.ns, k), {"op": "lease", "key": k, "ttl_s": ttl_s})
        return None if r is None else bool(r[0]["acquired"])

    # -- batches ----------------------------------------------------------------------------------
    def put_many(self, items) -> list[bool]:
        """items: dict or (key, value) pairs; one request per server, all servers in parallel."""
        pairs = list(items.items() if isinstance(items, dict) else items)
        ks = [wire_key(k) for k, _ in pairs]
        bufs = [as_buffer(v) for _, v in pairs]

        def one(sid, idx):
            r = self._call(sid, {"op": "put_many", "keys": [ks[i] for i in idx], "lens": [len(bufs[i]) for i in idx]}, [bufs[i] for i in idx])
            return r[0]["stored"] if r else [False] * len(idx)

        return self._fanout(ks, one, False)

    def get_many(self, keys) -> list[bytes | None]:
        ks = [wire_key(k) for k in keys]
        return self._fanout(ks, lambda sid, idx: self._get_group(sid, [ks[i] for i in idx]), None)

    def _hit(self, sid: str, s: _Server, keys: list[str]) -> None:
        """Report reads served from shared memory to the server's LRU, in batches."""
        batch = s.local.hit(keys)
        if batch:
            self._call(sid, {"op": "touch", "keys": batch})

    def _get_group(self, sid: str | None, keys: list[str]) -> list[bytes | None]:
        s = self._server(sid) if sid else None
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
