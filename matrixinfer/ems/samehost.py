"""A client's direct line to an MP server on the same host: its arena and location index,
mapped read-only. Reads here involve no request to the server (see docs/ems.md, "Reads")."""

from __future__ import annotations

import threading
import time

from .arena import ArenaReader
from .shmindex import ShmIndexReader, key_tags
from .view import Member

TOUCH_BATCH, TOUCH_EVERY_S = 256, 0.5  # how reads served here are reported to the server's LRU
ALIVE_EVERY_S = 0.1  # how often we check that the server process still lives


class SameHost:
    def __init__(self, m: Member):
        self.reader: ArenaReader | None = ArenaReader(m.shm)
        self.index: ShmIndexReader | None = ShmIndexReader(m.idx) if m.idx else None
        self.hits: list[str] = []  # keys read here, not yet reported
        self.lock = threading.Lock()
        self.touched_at = self.alive_at = time.monotonic()

    @classmethod
    def open(cls, m: Member, enabled: bool = True) -> "SameHost | None":
        if not enabled or not m.same_host():
            return None
        try:
            return cls(m)
        except OSError:
            return None  # not visible to us after all: use TCP

    def arena(self) -> ArenaReader | None:
        """The arena, unless the server died: its arena outlives it in /dev/shm (stale data),
        but its flock on the file does not. Callers keep the returned reader: another thread
        may drop ours meanwhile."""
        reader, now = self.reader, time.monotonic()
        if reader is not None and now - self.alive_at > ALIVE_EVERY_S:
            self.alive_at = now
            if not reader.server_alive():
                self.reader = self.index = None  # closed when the last user lets go
                return None
        return reader

    def locate(self, ns: str, key: str) -> tuple[int, int, int, int] | None:
        """(offset, length, token, check) from the shared index; the arena read verifies it."""
        index = self.index
        if index is None:
            return None
        tag, check = key_tags(ns, key)
        loc = index.find(tag)
        return None if loc is None else (*loc, check)

    def get(self, ns: str, key: str) -> bytes | None:
        reader, loc = self.arena(), self.locate(ns, key)
        if reader is None or loc is None:
            return None
        return reader.read_bytes(loc[0], loc[2], loc[1], loc[3])

    def get_into(self, ns: str, key: str, dst: memoryview) -> int | None:
        reader, loc = self.arena(), self.locate(ns, key)
        if reader is None or loc is None or loc[1] > len(dst):
            return None
        return loc[1] if reader.read_into(loc[0], loc[2], loc[1], loc[3], dst) else None

    def hit(self, keys: list[str]) -> list[str] | None:
        """Record reads served here; returns a batch to report (`touch`) when one is due."""
        with self.lock:
            self.hits.extend(keys)
            now = time.monotonic()
            if len(self.hits) < TOUCH_BATCH and now - self.touched_at <= TOUCH_EVERY_S:
                return None
            batch, self.hits, self.touched_at = self.hits[-4096:], [], now
            return batch

    def close(self) -> None:
        for m in (self.reader, self.index):
            if m is not None:
                m.close()
