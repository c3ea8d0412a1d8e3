"""One MP server's shard: DRAM arena (hot, LRU) over the SSD log (durable), per namespace.

Life of a put: allocate a *pending* block (invisible) -> fill it -> append to the SSD log and
wait until durable -> publish (index + header token) -> acknowledge. A reader therefore never
sees a half-written object, and everything acknowledged survives a crash.

Eviction: a namespace over its DRAM share evicts its own least-recently-used objects; when
the arena itself is full the global LRU goes first. DRAM eviction loses nothing (the SSD
holds every object); a namespace over its SSD share drops its oldest objects for good.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from .arena import HEADER_BYTES, Arena, round_up
from .protocol import EMSError
from .shmindex import ShmIndex, key_tags
from .ssd import Loc, SegmentLog

UNLIMITED = 1 << 62


@dataclass
class Block:
    off: int
    length: int
    size: int  # bytes taken from the arena (header + value, aligned)
    ns: str
    loc: Loc | None = None  # SSD record this block caches; orders concurrent puts
    token: int = 0
    tag: int = 0  # shmindex.key_tags of (ns, key): index slot tag
    check: int = 0  # ... and the block header's key check
    pins: int = 0  # TCP senders still streaming from it
    dead: bool = False  # unlinked from the index; freed when the last pin goes


@dataclass
class Quota:
    dram: int = UNLIMITED
    ssd: int = UNLIMITED


@dataclass
class Counters:
    hits_dram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    puts: int = 0
    evictions_dram: int = 0
    evictions_ssd: int = 0
    promotion_skipped: int = 0


class Shard:
    def __init__(self, arena: Arena, ssd: SegmentLog, shm_index: ShmIndex | None = None):
        self.arena, self.ssd, self.shm_index = arena, ssd, shm_index
        self.lock = threading.Lock()
        self.index: dict[tuple[str, str], Block] = {}
        self.lru: OrderedDict[tuple[str, str], None] = OrderedDict()  # global, oldest first
        self.ns_lru: dict[str, OrderedDict[str, None]] = {}
        self.ns_dram: dict[str, int] = {}
        self.quotas: dict[str, Quota] = {}
        self.n = Counters()
        self.leases: dict[tuple[str, str], float] = {}

    # -- quotas -------------------------------------------------------------------------------
    def set_quotas(self, quotas: dict[str, Quota]) -> None:
        """Replace the quotas; a namespace whose share shrank is brought under it now (DRAM:
        its own LRU objects, still on SSD; SSD: its own oldest objects), not at its next put."""
        with self.lock:
            old, self.quotas = self.quotas, dict(quotas)
            shrunk = [ns for ns, q in quotas.items() if ns not in old or q.dram < old[ns].dram or q.ssd < old[ns].ssd]
            for ns in shrunk:
                while self.ns_dram.get(ns, 0) > quotas[ns].dram and self._evict_one(ns):
                    pass
        for ns in shrunk:
            self._enforce_ssd_quota(ns)

    def set_quota(self, ns: str, quota: Quota) -> None:
        self.set_quotas({**self.quotas, ns: quota})

    def quota(self, ns: str) -> Quota:
        return self.quotas.get(ns) or Quota()

    # -- DRAM bookkeeping (caller holds self.lock) ------------------------------------------------
    def _touch(self, ns: str, key: str) -> None:
        self.lru.move_to_end((ns, key))
        self.ns_lru[ns].move_to_end(key)

    def _unlink(self, ns: str, key: str) -> None:
        blk = self.index.pop((ns, key))
        self.lru.pop((ns, key), None)
        self.ns_lru[ns].pop(key, None)
        blk.dead = True
        if self.shm_index is not None:
            self.shm_index.remove(blk.tag, blk.token)
        self.arena.publish(blk.off, 0, 0)  # same-host readers see the block is gone
        if blk.pins == 0:
            self._free(blk)

    def _free(self, blk: Block) -> None:
        self.arena.release(blk.off)
        self.ns_dram[blk.ns] -= blk.size

    def _evict_one(self, ns: str | None) -> bool:
        order = self.lru if ns is None else self.ns_lru.get(ns)
        if not order:
            return False
        victim = next(iter(order))
        vns, vkey = victim if ns is None else (ns, victim)
        self._unlink(vns, vkey)
        self.n.evictions_dram += 1
        return True

    def _alloc(self, ns: str, length: int) -> Block | None:
        """A pending block for `length` bytes, evicting inside `ns` first, then globally."""
        size = round_up(HEADER_BYTES + length)
        q = self.quota(ns).dram
        if size > min(q, self.arena.alloc.capacity):
            return None
        while self.ns_dram.get(ns, 0) + size > q:
            if not self._evict_one(ns):
                return None  # the rest of the namespace is pending or pinned
        while (off := self.arena.allocate(length)) is None:
            if not self._evict_one(None):
                return None
        self.ns_dram[ns] = self.ns_dram.get(ns, 0) + self.arena.alloc.block_size(off)
        self.ns_lru.setdefault(ns, OrderedDict())
        return Block(off, length, self.arena.alloc.block_size(off), ns)

    def _publish(self, ns: str, key: str, blk: Block) -> bool:
        """Make a filled block visible unless a newer version is already there."""
        cur = self.index.get((ns, key))
        if cur is not None and blk.loc is not None and cur.loc is not None and cur.loc > blk.loc:
            self._free(blk)
            return False
        if cur is not None:
            self._unlink(ns, key)
        blk.token = random.getrandbits(63) | 1
        blk.tag, blk.check = key_tags(ns, key)
        self.arena.publish(blk.off, blk.token, blk.length, blk.check)
        if self.shm_index is not None:
            self.shm_index.insert(blk.tag, blk.off, blk.length, blk.token)
        self.index[(ns, key)] = blk
        self.lru[(ns, key)] = None
        self.ns_lru[ns][key] = None
        return True

    # -- operations --------------------------------------------------------------------------------
    def begin_put(self, ns: str, key: str, length: int) -> Block:
        if length > self.quota(ns).ssd:  # it would be evicted from SSD as soon as it was written
            raise EMSError(f"value of {length} bytes does not fit namespace {ns!r} SSD share")
        with self.lock:
            blk = self._alloc(ns, length)
        if blk is None:
            raise EMSError(f"value of {length} bytes does not fit namespace {ns!r} DRAM share")
        return blk

    def abort_put(self, blk: Block) -> None:
        with self.lock:
            self._free(blk)

    def commit_put(self, ns: str, key: str, blk: Block) -> None:
        self.commit_many(ns, [(key, blk)])

    def commit_many(self, ns: str, items: list[tuple[str, Block]]) -> None:
        """SSD first (durable, one fsync per batch), then visible in DRAM.
        Raises OSError if the disk write fails (nothing of the batch becomes visible)."""
        try:
            locs = self.ssd.put_many(ns, [(key, self.arena.data(b.off, b.length)) for key, b in items])
        except BaseException:
            for _, b in items:
                self.abort_put(b)
            raise
        with self.lock:
            for (key, blk), loc in zip(items, locs):
                blk.loc = loc
                self._publish(ns, key, blk)
                self.leases.pop((ns, key), None)
                self.n.puts += 1
        self._enforce_ssd_quota(ns)

    def _enforce_ssd_quota(self, ns: str) -> None:
        q = self.quota(ns).ssd
        while self.ssd.ns_bytes.get(ns, 0) > q:
            key = self.ssd.oldest(ns)
            if key is None:
                break
            self.delete(ns, key)
            self.n.evictions_ssd += 1

    def lookup(self, ns: str, key: str, pin: bool) -> tuple[Block | None, memoryview] | None:
        """(block, value view) of a key, promoting it from SSD if needed; None on a miss.

        With `pin`, the block stays allocated until `unpin` (a TCP sender streams from it).
        The block is None when DRAM had no room and the value was read into a private copy.
        """
        with self.lock:
            blk = self.index.get((ns, key))
            if blk is not None:
                self._touch(ns, key)
                self.n.hits_dram += 1
                blk.pins += pin
                return blk, self.arena.data(blk.off, blk.length)
        return self._promote(ns, key, pin)

    def _promote(self, ns: str, key: str, pin: bool) -> tuple[Block | None, memoryview] | None:
        loc = self.ssd.loc(ns, key)
        with self.lock:
            blk = self._alloc(ns, loc.length) if loc is not None else None
        if loc is None:
            self.n.misses += 1
            return None
        if blk is None:  # no DRAM for it: serve a private copy, skip the promotion
            out = memoryview(bytearray(loc.length))
            if not self.ssd.read_into(ns, key, loc, out):
                self.n.misses += 1
                return None
            self.n.promotion_skipped += 1
            return None, out
        if not self.ssd.read_into(ns, key, loc, self.arena.data(blk.off, blk.length)):
            self.abort_put(blk)
            self.n.misses += 1
            return None
        blk.loc = loc
        with self.lock:
            cur = self.index.get((ns, key))
            if cur is not None or self.ssd.loc(ns, key) != loc:  # raced with another get or a put
                self._free(blk)
                if cur is None:
                    self.n.misses += 1
                    return None
                blk = cur
            else:
                self._publish(ns, key, blk)
            self._touch(ns, key)
            self.n.hits_ssd += 1
            blk.pins += pin
            return blk, self.arena.data(blk.off, blk.length)

    def peek(self, ns: str, key: str) -> bytes | None:
        """A copy of a value that leaves the LRU and DRAM as they are (no promotion): what
        background re-replication sends, so it does not push hot objects out of DRAM."""
        with self.lock:
            blk = self.index.get((ns, key))
            if blk is not None:
                return bytes(self.arena.data(blk.off, blk.length))
        return self.ssd.get(ns, key)

    def unpin(self, blk: Block) -> None:
        with self.lock:
            blk.pins -= 1
            if blk.pins == 0 and blk.dead:
                self._free(blk)

    def touch(self, ns: str, keys: list[str]) -> None:
        """Same-host clients read through the shared index without asking us; they report
        their hits in batches so the LRU still sees them."""
        with self.lock:
            for key in keys:
                if (ns, key) in self.index:
                    self._touch(ns, key)
                    self.n.hits_dram += 1

    def exists(self, ns: str, key: str) -> bool:
        with self.lock:
            if (ns, key) in self.index:
                return True
        return self.ssd.contains(ns, key)

    def delete(self, ns: str, key: str) -> bool:
        on_ssd = self.ssd.delete(ns, key)
        with self.lock:
            in_dram = (ns, key) in self.index
            if in_dram:
                self._unlink(ns, key)
        return on_ssd or in_dram

    def lease(self, ns: str, key: str, ttl_s: float, now: float) -> bool:
        """Single-flight: the first caller to ask for an absent key gets to fill it."""
        if self.exists(ns, key):
            return False
        with self.lock:
            if self.leases.get((ns, key), 0) > now:
                return False
            self.leases[(ns, key)] = now + ttl_s
            return True

    def stats(self) -> dict:
        with self.lock:
            return {
                "arena": self.arena.alloc.stats(),
                "dram_objects": len(self.index),
                "ns_dram_bytes": dict(self.ns_dram),
                "ns_ssd_bytes": dict(self.ssd.ns_bytes),
                "counters": vars(self.n).copy(),
                **self.ssd.stats(),
            }
