"""Consistent-hash ring with virtual nodes: which MP server owns a key.

Each server sits at `vnodes` points on a 64-bit ring; a key belongs to the first point at or
after its hash (its replicas to the next distinct servers after it). Adding an (N+1)-th
server takes over about 1/(N+1) of the keys and moves nothing else; removing one hands only
its keys to the others.
"""

from __future__ import annotations

import bisect
import hashlib


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, servers: list[str] = (), vnodes: int = 160):
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owner: dict[int, str] = {}
        self.servers: set[str] = set()
        for s in servers:
            self.add(s)

    def add(self, server: str) -> None:
        if server in self.servers:
            return
        self.servers.add(server)
        for i in range(self.vnodes):
            p = hash64(f"{server}#{i}".encode())
            if p in self._owner:  # 64-bit collision: astronomically rare, keep the first owner
                continue
            self._owner[p] = server
            bisect.insort(self._points, p)

    def remove(self, server: str) -> None:
        if server not in self.servers:
            return
        self.servers.discard(server)
        self._points = [p for p in self._points if self._owner[p] != server]
        self._owner = {p: s for p, s in self._owner.items() if s != server}

    def lookup(self, key: bytes | str) -> str | None:
        if not self._points:
            return None
        if isinstance(key, str):
            key = key.encode("latin-1")
        i = bisect.bisect_left(self._points, hash64(key))
        return self._owner[self._points[i % len(self._points)]]

    def lookup_n(self, key: bytes | str, n: int) -> list[str]:
        """The key's owner and the next distinct servers clockwise: its `n` replica holders
        (fewer when the ring has fewer servers). The first is `lookup(key)`; removing a
        server shifts the others up a place, so survivors keep the key."""
        if not self._points:
            return []
        if isinstance(key, str):
            key = key.encode("latin-1")
        n, out = min(n, len(self.servers)), []
        i = bisect.bisect_left(self._points, hash64(key))
        while len(out) < n:
            s = self._owner[self._points[i % len(self._points)]]
            if s not in out:
                out.append(s)
            i += 1
        return out

    def share(self, server: str) -> float:
        """Fraction of the ring (so, of uniformly hashed keys) that `server` owns."""
        owned = 0
        for i, p in enumerate(self._points):
            if self._owner[p] == server:
                owned += (p - self._points[i - 1]) % (1 << 64)  # the arc ending at p; i=0 wraps
        return owned / (1 << 64) if len(self.servers) > 1 else float(server in self.servers)

    def __len__(self) -> int:
        return len(self.servers)
