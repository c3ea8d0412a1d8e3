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


def placement_key(ns: str, key: str) -> bytes:
    return ns.encode("utf-8") + b"\0" + key.encode("latin-1")


def by_server(placements: list[list[str]], rank: int | None = None) -> dict[str, list[int]]:
    """Indices of keys grouped by server: under every holder (`rank` None: writes, exists,
    deletes) or under the `rank`-th holder only (a read's rank-th try)."""
    groups: dict[str, list[int]] = {}
    for i, holders in enumerate(placements):
        for sid in (holders if rank is None else holders[rank : rank + 1]):
            groups.setdefault(sid, []).append(i)
    return groups


def fold(n: int, results: list[tuple[list[int], list]], combine) -> list[bool]:
    """Per key, `combine` (all / any) of what each of its servers said; False for a key with
    no server at all."""
    votes: list[list[bool]] = [[] for _ in range(n)]
    for idx, values in results:
        for i, v in zip(idx, values):
            votes[i].append(bool(v))
    return [bool(v) and combine(v) for v in votes]


class FirstHolder:
    """A read over replicas: every key from its first holder, in rounds: the misses of one
    round (absent there, or the server unreachable) go to their next holder in the next.

        r = FirstHolder(placements)
        while groups := r.round():
            r.merge(ask(groups))    # [(indices, values)]
        r.values
    """

    def __init__(self, placements: list[list[str]]):
        self.placements = placements
        self.values: list = [None] * len(placements)
        self._need = set(range(len(placements)))
        self._rank = 0

    def round(self) -> dict[str, list[int]]:
        """This round's requests by server; empty when every key is found or out of holders."""
        if not self._need:
            return {}
        groups = by_server([p if i in self._need else [] for i, p in enumerate(self.placements)], self._rank)
        self._rank += 1
        return groups

    def merge(self, results: list[tuple[list[int], list]]) -> None:
        for idx, values in results:
            for i, v in zip(idx, values):
                self.values[i] = v
        self._need = {i for i in self._need if self.values[i] is None}


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
        return self.ring.lookup(placement_key(ns, key))

    def owners(self, ns: str, key: str, replicas: int) -> list[str]:
        """The servers that hold a key of a namespace with `replicas` copies: the owner first,
        then the next distinct servers on the ring (fewer when the pool is smaller)."""
        return self.ring.lookup_n(placement_key(ns, key), replicas)
