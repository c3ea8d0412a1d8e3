"""The MP server's SSD tier: an append-only segment log with an in-memory index.

Why a log and not an embedded store (see docs/ems.md): EMS objects are immutable blobs of
64 KiB-4 MiB written once and read whole, so a log appends each one with one sequential
write, can group-commit the fsyncs of concurrent puts, and rebuilds its index with one scan
of the headers. A B-tree store (sqlite) would split every blob into overflow pages and
rewrite them on delete; an LSM store is not available without a new dependency.

Record = header | namespace | key | value. The header has its own CRC (a torn or corrupt
header ends the scan of a segment) and the CRC of the value (checked on every read: a
corrupt value is a miss, never wrong bytes).
"""

from __future__ import annotations

import os
import re
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

# magic, header crc, value crc, kind, namespace length, key length, value length
REC = __import__("struct").Struct("<IIIBxHIQ")
MAGIC = 0x454D5331  # "EMS1"
PUT, DEL = 1, 2
SEG_RE = re.compile(r"^seg-(\d{8})\.log$")


@dataclass(frozen=True, order=True)
class Loc:
    seg: int
    rec_off: int  # where the record starts; (seg, rec_off) orders records by write time
    val_off: int
    length: int
    crc: int


def _header(kind: int, ns: bytes, key: bytes, value_len: int, value_crc: int) -> bytes:
    body = REC.pack(MAGIC, 0, value_crc, kind, len(ns), len(key), value_len)[8:] + ns + key
    return REC.pack(MAGIC, zlib.crc32(body), value_crc, kind, len(ns), len(key), value_len) + ns + key


class SegmentLog:
    def __init__(self, directory: str, segment_bytes: int = 64 << 20, fsync: str = "always"):
        if fsync not in ("always", "never"):
            raise ValueError("fsync must be 'always' or 'never'")
        self.dir, self.segment_bytes, self.fsync = directory, segment_bytes, fsync
        os.makedirs(directory, exist_ok=True)
        self.index: dict[tuple[str, str], Loc] = {}
        self.order: dict[str, OrderedDict] = {}  # namespace -> keys, oldest first (SSD eviction)
        self.ns_bytes: dict[str, int] = {}
        self.live: dict[int, int] = {}  # segment -> live value bytes (for compaction)
        self.lock = threading.Lock()  # appends and index
        self._sync_lock = threading.Lock()
        self._readers: dict[int, int] = {}
        self.corrupt_reads = 0
        self.recovered = self._recover()
        self._open_active()

    # -- files ----------------------------------------------------------------------------
    def _path(self, seg: int) -> str:
        return os.path.join(self.dir, f"seg-{seg:08d}.log")

    def segments(self) -> list[int]:
        return sorted(int(m.group(1)) for f in os.listdir(self.dir) if (m := SEG_RE.match(f)))

    def _open_active(self) -> None:
        segs = self.segments()
        self.seg = segs[-1] if segs else 1
        self.fd = os.open(self._path(self.seg), os.O_WRONLY | os.O_CREAT, 0o644)
        self.pos = os.lseek(self.fd, 0, os.SEEK_END)
        self.durable = (self.seg, self.pos)
        self._dirfsync()

    def _dirfsync(self) -> None:
        if self.fsync == "always":  # a new segment file must survive a crash too
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _reader(self, seg: int) -> int:
        fd = self._readers.get(seg)
        if fd is None:
            fd = self._readers[seg] = os.open(self._path(seg), os.O_RDONLY)
        return fd

    # -- recovery ---------------------------------------------------------------------------
    def _recover(self) -> int:
        """Rebuild the index from the segment headers; cut a torn tail off the last segment."""
        segs, n = self.segments(), 0
        for i, seg in enumerate(segs):
            path = self._path(seg)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                off = 0
                while off + REC.size <= size:
                    f.seek(off)
                    head = f.read(REC.size)
                    magic, hcrc, vcrc, kind, nsl, kl, vl = REC.unpack(head)
                    names = f.read(nsl + kl)
                    end = off + REC.size + nsl + kl + vl
                    if magic != MAGIC or len(names) != nsl + kl or end > size or zlib.crc32(head[8:] + names) != hcrc:
                        break
                    ns, key = names[:nsl].decode("latin-1"), names[nsl:].decode("latin-1")
                    loc = Loc(seg, off, off + REC.size + nsl + kl, vl, vcrc)
                    self._index_set(ns, key, loc if kind == PUT else None)
                    n += 1
                    off = end
            if off < size and i == len(segs) - 1:
                os.truncate(path, off)  # torn write at the tail: it was never acknowledged
        return n

    # -- index ------------------------------------------------------------------------------
    def _index_set(self, ns: str, key: str, loc: Loc | None) -> None:
        old = self.index.pop((ns, key), None)
        order = self.order.setdefault(ns, OrderedDict())
        if old is not None:
            order.pop(key, None)
            self.ns_bytes[ns] -= old.length
            self.live[old.seg] -= old.length
        if loc is not None:
            self.index[(ns, key)] = loc
            order[key] = None
            self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + loc.length
            self.live[loc.seg] = self.live.get(loc.seg, 0) + loc.length

    def contains(self, ns: str, key: str) -> bool:
        return (ns, key) in self.index

    def keys(self, ns: str) -> list[str]:
        """Every key of a namespace this log holds (a snapshot; re-replication walks it)."""
        with self.lock:
            return list(self.order.get(ns, ()))

    def oldest(self, ns: str) -> str | None:
        order = self.order.get(ns)
        return next(iter(order)) if order else None

    # -- write path -------------------------------------------------------------------------
    def _append(self, kind: int, ns: str, key: str, value: memoryview) -> Loc:
        nsb, kb = ns.encode("latin-1"), key.encode("latin-1")
        vcrc = zlib.crc32(value) if kind == PUT else 0
        head = _header(kind, nsb, kb, len(value), vcrc)
        with self.lock:
            if self.pos > 0 and self.pos + len(head) + len(value) > self.segment_bytes:
                self._rotate()
            loc = Loc(self.seg, self.pos, self.pos + len(head), len(value), vcrc)
            self._write_all(head)
            self._write_all(value)
        return loc

    def _write_all(self, data) -> None:
        mv = memoryview(data)
        while len(mv):
            k = os.write(self.fd, mv)
            mv = mv[k:]
            self.pos += k

    def _rotate(self) -> None:
        if self.fsync == "always":
            os.fsync(self.fd)
        os.close(self.fd)
        self.seg += 1
        self.fd = os.open(self._path(self.seg), os.O_WRONLY | os.O_CREAT, 0o644)
        self.pos = 0
        self._dirfsync()

    def _sync(self, loc: Loc) -> None:
        """Group commit: one fsync covers every record appended before it."""
        if self.fsync != "always":
            return
        with self._sync_lock:
            if self.durable >= (loc.seg, loc.val_off + loc.length):
                return  # someone else's fsync already covered us
            with self.lock:
                upto = (self.seg, self.pos)
                if loc.seg < self.seg:  # rotated: the old segment was fsynced on rotation
                    self.durable = max(self.durable, (loc.seg, loc.val_off + loc.length))
                    return
                # Our own descriptor of the segment: a rotation between here and the fsync
                # closes self.fd (and a new segment may reuse its number), never this one.
                fd = os.dup(self.fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.durable = max(self.durable, upto)

    def put(self, ns: str, key: str, value: memoryview) -> Loc:
        return self.put_many(ns, [(key, value)])[0]

    def put_many(self, ns: str, items: list[tuple[str, memoryview]]) -> list[Loc]:
        """Returns once every record is durable (fsync policy 'always': one fsync for the
        batch); only then are they indexed."""
        locs = [self._append(PUT, ns, key, value) for key, value in items]
        if locs:
            self._sync(locs[-1])  # earlier segments of the batch were fsynced when rotated
        with self.lock:
            for (key, _), loc in zip(items, locs):
                cur = self.index.get((ns, key))
                if cur is None or cur < loc:  # a later put of the same key wins
                    self._index_set(ns, key, loc)
        return locs

    def loc(self, ns: str, key: str) -> Loc | None:
        with self.lock:
            return self.index.get((ns, key))

    def delete(self, ns: str, key: str) -> bool:
        with self.lock:
            if (ns, key) not in self.index:
                return False
        loc = self._append(DEL, ns, key, memoryview(b""))
        self._sync(loc)
        with self.lock:
            cur = self.index.get((ns, key))
            if cur is not None and cur < loc:
                self._index_set(ns, key, None)
        return True

    # -- read path --------------------------------------------------------------------------
    def read_into(self, ns: str, key: str, loc: Loc, out: memoryview) -> bool:
        """Read the value at `loc` into `out`; False (and the key dropped) if it is corrupt."""
        got = 0
        try:
            with self.lock:
                fd = self._reader(loc.seg)
            while got < loc.length:
                k = os.preadv(fd, [out[got:]], loc.val_off + got)
                if k == 0:
                    break
                got += k
        except OSError:
            return False  # the segment was compacted away under us: a miss
        if got != loc.length or zlib.crc32(out) != loc.crc:
            self.corrupt_reads += 1
            with self.lock:
                if self.index.get((ns, key)) == loc:
                    self._index_set(ns, key, None)  # never serve it again
            return False
        return True

    def get(self, ns: str, key: str) -> bytes | None:
        loc = self.loc(ns, key)
        if loc is None:
            return None
        out = bytearray(loc.length)
        return bytes(out) if self.read_into(ns, key, loc, memoryview(out)) else None

    # -- compaction ---------------------------------------------------------------------------
    def compact(self, min_dead_ratio: float = 0.5) -> int:
        """Rewrite the live records of the oldest sealed segments while they are mostly dead.

        Oldest first and stopping at the first segment worth keeping: a tombstone can then
        only refer to a put in its own or an already-removed segment, so dropping it can
        never resurrect a deleted key on restart. Returns the number of segments freed.
        """
        freed = 0
        for seg in self.segments():
            if seg >= self.seg:
                break
            size = os.path.getsize(self._path(seg))
            if size and 1 - self.live.get(seg, 0) / size < min_dead_ratio:
                break
            with self.lock:
                movers = [(k, loc) for k, loc in self.index.items() if loc.seg == seg]
            for (ns, key), loc in movers:
                value = self.get(ns, key)
                with self.lock:
                    still = value is not None and self.index.get((ns, key)) == loc
                if still:
                    self.put(ns, key, memoryview(value))
            with self.lock:
                if any(loc.seg == seg for loc in self.index.values()):
                    break  # raced with a writer; try again next time
                fd = self._readers.pop(seg, None)
                if fd is not None:
                    os.close(fd)
                os.unlink(self._path(seg))
                self.live.pop(seg, None)
            freed += 1
        return freed

    def stats(self) -> dict:
        return {
            "ssd_objects": len(self.index),
            "ssd_bytes": sum(self.ns_bytes.values()),
            "segments": len(self.segments()),
            "corrupt_reads": self.corrupt_reads,
            "recovered_records": self.recovered,
        }

    def close(self) -> None:
        with self.lock:
            if self.fsync == "always":
                os.fsync(self.fd)
            os.close(self.fd)
            for fd in self._readers.values():
                os.close(fd)
            self._readers.clear()
