"""A client's picture of the pool: the controller's view turned into a local hash ring."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from .ring import HashRing


def boot_id() -> str:
    """Identifies this kernel boot; same boot id + same hostname = same host = shared memory works."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return socket.gethostname() + "/" + f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass
class Member:
    id: str
    host: str
    port: int
    shm: str | None = None
    idx: str | None = None
    boot_id: str | None = None

    def same_host(self) -> bool:
        """Can we map this server's shared memory? (same hostname and kernel boot)"""
        return bool(self.shm) and self.boot_id == boot_id()


@dataclass
class ClusterView:
    version: int = -1
    members: dict[str, Member] = field(default_factory=dict)
    ring: HashRing = field(default_factory=HashRing)

    @classmethod
    def from_reply(cls, reply: dict) -> "ClusterView":
        members = {m["id"]: Member(**m) for m in reply["servers"]}
        return cls(reply["version"], members, HashRing(sorted(members), reply.get("vnodes", 160)))

    def owner(self, ns: str, key: str) -> str | None:
        """Namespace is part of the placement hash, so tenants spread independently."""
        return self.ring.lookup(ns.encode("utf-8") + b"\0" + key.encode("latin-1"))

    def route(self, ns: str, keys: list[str]) -> dict[str | None, list[int]]:
        """Indices of `keys` grouped by owning server (None: the pool has no servers)."""
        groups: dict[str | None, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self.owner(ns, k), []).append(i)
        return groups


def scatter(n: int, parts, fill) -> list:
    """Put per-server results [(indices, values)] back into key order."""
    out = [fill] * n
    for idx, values in parts:
        for i, v in zip(idx, values):
            out[i] = v
    return out
