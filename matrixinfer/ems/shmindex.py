"""Same-host location index: the MP server publishes where each DRAM object lives in a
shared-memory hash table, so a client on the same host finds and copies a value with no
round trip to the server (UB-style: the server's CPU is not on the read path).

Open addressing, linear probing over at most PROBES slots; one writer (the server, under its
shard lock), lock-free readers. A slot is (tag, offset, length, token); the tag is the first
64 bits of blake2b(namespace, key). A slot read may be torn by a concurrent update, so a
reader trusts nothing it read here: it checks the block header in the arena, which holds the
same (token, length) and the *second* 64 bits of the key's hash, before and after copying.
A stale or torn slot therefore costs a fallback to the RPC path, never wrong bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct

from .arena import create_mapping, drop_mapping, open_mapping

SLOT = struct.Struct("<QQQQ")  # tag, offset, length, token
EMPTY, TOMBSTONE = 0, 1
PROBES = 32


def key_tags(ns: str, key: str) -> tuple[int, int]:
    """Two independent 64-bit hashes of (namespace, key): slot tag and header check."""
    d = hashlib.blake2b(ns.encode("utf-8") + b"\0" + key.encode("latin-1"), digest_size=16).digest()
    tag, check = int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")
    return (tag if tag > TOMBSTONE else tag + 2), check


def slots_for(arena_bytes: int) -> int:
    """About one slot per 2 KiB of arena (power of two): room for many small objects."""
    n = 4096
    while n < arena_bytes // 2048:
        n *= 2
    return n


class ShmIndex:
    """The server's side: insert on publish, remove on unlink (caller holds the shard lock)."""

    def __init__(self, path: str, slots: int):
        self.path, self.slots, self.mask = path, slots, slots - 1
        fd, self.mm = create_mapping(path, slots * SLOT.size)
        os.close(fd)
        self.full = 0  # inserts that found no slot within PROBES (those keys use the RPC path)

    def insert(self, tag: int, off: int, length: int, token: int) -> None:
        free = None
        for i in range(PROBES):
            pos = ((tag + i) & self.mask) * SLOT.size
            t = struct.unpack_from("<Q", self.mm, pos)[0]
            if t == tag:
                free = pos
                break
            if t in (EMPTY, TOMBSTONE) and free is None:
                free = pos
                if t == EMPTY:
                    break
        if free is None:
            self.full += 1
            return
        # Tag last: a reader that matches the tag mostly sees the new fields (and checks anyway).
        SLOT.pack_into(self.mm, free, TOMBSTONE, off, length, token)
        struct.pack_into("<Q", self.mm, free, tag)

    def remove(self, tag: int, token: int) -> None:
        for i in range(PROBES):
            pos = ((tag + i) & self.mask) * SLOT.size
            t, _, _, tok = SLOT.unpack_from(self.mm, pos)
            if t == EMPTY:
                return
            if t == tag and tok == token:
                struct.pack_into("<Q", self.mm, pos, TOMBSTONE)
                return

    def close(self) -> None:
        drop_mapping(self.mm, unlink=self.path)


class ShmIndexReader:
    """A same-host client's read-only view of a server's index."""

    def __init__(self, path: str):
        fd, self.mm = open_mapping(path)
        os.close(fd)
        self.mask = len(self.mm) // SLOT.size - 1

    def find(self, tag: int) -> tuple[int, int, int] | None:
        """(offset, length, token) the slot claims for this tag; the caller must verify it."""
        for i in range(PROBES):
            t, off, length, token = SLOT.unpack_from(self.mm, ((tag + i) & self.mask) * SLOT.size)
            if t == tag:
                return off, length, token
            if t == EMPTY:
                return None
        return None

    def close(self) -> None:
        drop_mapping(self.mm)
