"""EMS client library for asyncio: the same API as EMSClient, awaitable.

    c = await AsyncEMSClient.connect("127.0.0.1:7900", namespace="tenant-a")
    await c.put("k", b"v"); await c.get("k")

Batches go to all owning servers concurrently (asyncio.gather). Same failure rule as the sync
client: an unreachable server is a miss, bad input raises EMSError; a namespace with replicas
is written to all its holders and read from the first that has the key (client.py).
"""

from __future__ import annotations

import asyncio
import time

from .samehost import SameHost
from .protocol import (EMSError, as_buffer, async_recv_frame, async_send_frame, decode_get_reply, ns_create_header,
                       parse_addr, wire_key)
from .view import ClusterView, FirstHolder, by_server, fold

NET_ERRORS = (OSError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError)


class _AsyncConn:
    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.lock = asyncio.Lock()
        self.rw: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def call(self, header: dict, buffers=()) -> tuple[dict, bytes]:
        async with self.lock:
            try:
                return await asyncio.wait_for(self._call(header, buffers), self.timeout_s)
            except BaseException:
                self.close()  # the stream may be mid-frame: never reuse it
                raise

    async def _call(self, header, buffers):
        if self.rw is None:
            self.rw = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.rw
        async_send_frame(writer, header, buffers)
        await writer.drain()
        reply, payload = await async_recv_frame(reader)
        if reply.get("ok") is False:
            raise EMSError(reply.get("error", "request failed"))
        return reply, payload

    def close(self) -> None:
        if self.rw is not None:
            self.rw[1].close()
            self.rw = None


class AsyncEMSClient:
    def __init__(self, controller: str, namespace: str = "default", *, zero_copy: bool = True, timeout_s: float = 5.0):
        self.ctl_addr = parse_addr(controller)
        self.ns, self.zero_copy, self.timeout_s = namespace, zero_copy, timeout_s
        self.view = ClusterView()
        self.replicas = 1  # the namespace's, from the controller at every view refresh
        self._view_at = 0.0
        self._conns: dict[str, _AsyncConn] = {}
        self._local: dict[str, SameHost | None] = {}
        self._down: dict[str, float] = {}

    @classmethod
    async def connect(cls, controller: str, namespace: str = "default", *, replicas: int | None = None,
                      **kw) -> "AsyncEMSClient":
        """`replicas`: (re)define the namespace with that many copies; None: use it as it is."""
        c = cls(controller, namespace, **kw)
        await c._controller(ns_create_header(namespace, replicas=replicas, if_absent=replicas is None))
        await c.refresh_view(force=True)
        return c

    async def _controller(self, header: dict) -> dict:
        conn = _AsyncConn(*self.ctl_addr, self.timeout_s)
        try:
            return (await conn.call(header))[0]
        finally:
            conn.close()

    async def refresh_view(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._view_at < 1.0:
            return
        self._view_at = time.monotonic()
        try:
            reply = await self._controller({"op": "view", "ns": self.ns})
        except NET_ERRORS:
            return
        self.replicas = reply.get("replicas", 1)
        if reply["version"] != self.view.version:
            old, self.view = self.view, ClusterView.from_reply(reply)
            for sid, m in old.members.items():
                if self.view.members.get(sid) != m:  # gone, or restarted elsewhere
                    if sid in self._conns:
                        self._conns.pop(sid).close()
                    if self._local.get(sid):
                        self._local[sid].close()
                    self._local.pop(sid, None)

    def _same_host(self, sid: str | None) -> SameHost | None:
        m = self.view.members.get(sid) if sid else None
        if m is None or self._down.get(sid, 0) > time.monotonic():
            return None
        if sid not in self._local:
            self._local[sid] = SameHost.open(m, self.zero_copy)
        return self._local[sid]

    async def _call(self, sid: str | None, header: dict, buffers=()):
        m = self.view.members.get(sid) if sid else None
        if m is None or self._down.get(sid, 0) > time.monotonic():
            return None
        conn = self._conns.get(sid)
        if conn is None:
            conn = self._conns[sid] = _AsyncConn(m.host, m.port, self.timeout_s)
        try:
            return await conn.call({**header, "ns": self.ns}, buffers)
        except NET_ERRORS:
            self._down[sid] = time.monotonic() + 1.0
            self._view_at = 0.0
            return None

    async def _placements(self, keys: list[str]) -> list[list[str]]:
        await self.refresh_view()
        return [self.view.owners(self.ns, k, self.replicas) for k in keys]

    @staticmethod
    async def _each(groups: dict[str, list[int]], fn) -> list[tuple[list[int], list]]:
        items = list(groups.items())
        results = await asyncio.gather(*(fn(sid, idx) for sid, idx in items))
        return [(idx, r) for (_, idx), r in zip(items, results)]

    async def _all_holders(self, keys: list[str], fn, combine) -> list[bool]:
        """fn on every holder of every key concurrently, folded per key (all / any)."""
        return fold(len(keys), await self._each(by_server(await self._placements(keys)), fn), combine)

    async def _first_holder(self, keys: list[str], fn) -> list:
        """fn on each key's first holder, the misses then on the next holders."""
        read = FirstHolder(await self._placements(keys))
        while groups := read.round():
            read.merge(await self._each(groups, fn))
        return read.values

    async def put(self, key, value) -> bool:
        return (await self.put_many([(key, value)]))[0]

    async def get(self, key) -> bytes | None:
        return (await self.get_many([key]))[0]

    async def put_many(self, items) -> list[bool]:
        pairs = list(items.items() if isinstance(items, dict) else items)
        ks, bufs = [wire_key(k) for k, _ in pairs], [as_buffer(v) for _, v in pairs]

        async def one(sid, idx):
            r = await self._call(sid, {"op": "put_many", "keys": [ks[i] for i in idx], "lens": [len(bufs[i]) for i in idx]}, [bufs[i] for i in idx])
            return r[0]["stored"] if r else [False] * len(idx)

        return await self._all_holders(ks, one, all)

    async def get_many(self, keys) -> list[bytes | None]:
        ks = [wire_key(k) for k in keys]

        async def one(sid, idx):
            local = self._same_host(sid)
            reader = local.arena() if local else None
            group = [ks[i] for i in idx]
            if reader is not None:  # same host: no request for what the shared index has
                found = {k: v for k in group if (v := local.get(self.ns, k)) is not None}
                batch = local.hit(list(found))
                if batch:
                    await self._call(sid, {"op": "touch", "keys": batch})
                rest = [k for k in group if k not in found]
                if not rest:
                    return [found[k] for k in group]
            else:
                found, rest = {}, group
            r = await self._call(sid, {"op": "get_many", "keys": rest, "shm": reader is not None})
            if r is None:
                return [found.get(k) for k in group]
            for k, (view, loc) in zip(rest, decode_get_reply(*r)):
                if view is not None:
                    found[k] = bytes(view)
                elif loc is not None:
                    v = reader.read_bytes(loc[0], loc[2], loc[1], loc[3])
                    if v is None:  # replaced while we copied: fetch over TCP
                        rr = await self._call(sid, {"op": "get_many", "keys": [k], "shm": False})
                        v = rr[1] if rr and rr[0]["lens"][0] >= 0 else None
                    found[k] = v
            return [found.get(k) for k in group]

        return await self._first_holder(ks, one)

    async def exists(self, keys) -> list[bool]:
        ks = [wire_key(k) for k in keys]

        async def one(sid, idx):
            r = await self._call(sid, {"op": "exists", "keys": [ks[i] for i in idx]})
            return r[0]["found"] if r else [False] * len(idx)

        return await self._all_holders(ks, one, any)

    async def delete(self, key) -> bool:
        k = wire_key(key)

        async def one(sid, idx):
            r = await self._call(sid, {"op": "delete", "key": k})
            return [bool(r and r[0]["deleted"])]

        return (await self._all_holders([k], one, any))[0]

    async def close(self) -> None:
        for c in self._conns.values():
            c.close()
        self._conns.clear()
        for local in self._local.values():
            if local:
                local.close()
        self._local.clear()
