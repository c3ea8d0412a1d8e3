"""The MP server's DRAM tier: one pre-allocated shared-memory arena and its allocator.

The arena is a file in /dev/shm mapped by the server (read/write) and by same-host clients
(read-only): a client reads a value straight out of the server's memory, the stand-in for
UB zero-copy DMA. Blocks are variable-length (best fit, neighbours coalesced on free), each
with a small header so a reader can tell whether the block still holds the object it asked
for (see `BLOCK_HEADER`).
"""

from __future__ import annotations

import bisect
import fcntl
import glob
import mmap
import os
import struct
import time

from . import placement

# Pre-fault the mapping: the arena is allocated up front (as the paper's pinned DRAM pool),
# and a reader's first touch of each 4 KiB page would otherwise cost a page fault per get.
POPULATE = getattr(mmap, "MAP_POPULATE", 0)
ALIGN = 64  # cache line; also keeps tensors read out of the arena aligned
# Block header: (token, length, key check). The server writes it when an object becomes
# visible and zeroes it first when the block is freed, so a client that sees the same random
# token before and after its copy has read bytes of exactly that object; the key check (64
# bits of the key's hash, see shmindex.key_tags) proves the object is the key it asked for.
BLOCK_HEADER = struct.Struct("<QQQ")
HEADER_BYTES = ALIGN


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def create_mapping(path: str, size: int, lock: bool = False, populate: bool = True) -> tuple[int, mmap.mmap]:
    """A new shared file of `size` bytes, mapped read/write and (by default) pre-faulted;
    (fd, mapping). With `lock` the file is flocked before it has a size, so a reaper never
    takes a live arena for a dead one (see `reap_dead_arenas`)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (POPULATE if populate else 0))
    except BaseException:
        os.close(fd)
        raise


def open_mapping(path: str) -> tuple[int, mmap.mmap]:
    """Another process's shared file, mapped read-only and pre-faulted; (fd, mapping)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd, mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise


def drop_mapping(mm: mmap.mmap, view: memoryview | None = None, unlink: str | None = None) -> None:
    try:
        if view is not None:
            view.release()
        mm.close()
    except BufferError:
        pass  # another thread still holds a view; the mapping goes with the process
    if unlink:
        try:
            os.unlink(unlink)
        except FileNotFoundError:
            pass


class Allocator:
    """Best-fit variable-length allocator over [0, capacity) with coalescing on free."""

    def __init__(self, capacity: int, align: int = ALIGN):
        self.capacity = capacity - capacity % align
        self.align = align
        self._free_start: dict[int, int] = {}  # start -> size
        self._free_end: dict[int, int] = {}  # end -> start
        self._by_size: list[tuple[int, int]] = []  # sorted (size, start): best fit by bisect
        self._used: dict[int, int] = {}  # start -> size
        self.used_bytes = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    def _add_free(self, start: int, size: int) -> None:
        self._free_start[start] = size
        self._free_end[start + size] = start
        bisect.insort(self._by_size, (size, start))

    def _del_free(self, start: int) -> int:
        size = self._free_start.pop(start)
        del self._free_end[start + size]
        i = bisect.bisect_left(self._by_size, (size, start))
        del self._by_size[i]
        return size

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a block of at least `nbytes`, or None if no free extent is large enough."""
        n = round_up(max(nbytes, 1), self.align)
        i = bisect.bisect_left(self._by_size, (n, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size[i]
        self._del_free(start)
        if size > n:
            self._add_free(start + n, size - n)
        self._used[start] = n
        self.used_bytes += n
        return start

    def free(self, start: int) -> None:
        size = self._used.pop(start)
        self.used_bytes -= size
        prev = self._free_end.get(start)
        if prev is not None:  # merge with the free extent just before
            size += self._del_free(prev)
            start = prev
        if start + size in self._free_start:  # and with the one just after
            size += self._del_free(start + size)
        self._add_free(start, size)

    def block_size(self, start: int) -> int:
        return self._used[start]

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def fragmentation(self) -> float:
        """External fragmentation: 1 - largest free extent / all free bytes (0 = one extent)."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def stats(self) -> dict:
        return {
            "capacity": self.capacity,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "free_extents": len(self._by_size),
            "largest_free": self.largest_free,
            "fragmentation": round(self.fragmentation(), 4),
        }


ARENA_GLOB = "mi-ems-*"
CREATING_GRACE_S = 60.0  # an unlocked arena younger than this whose pid lives may be being created


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_dead(path: str) -> bool:
    """A live MP server holds an exclusive flock on its arena for its whole life."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # locked: its server lives
    finally:
        os.close(fd)  # also drops our lock
    try:
        pid = int(path.rsplit("-", 1)[1])
        young = time.time() - os.stat(path).st_mtime < CREATING_GRACE_S
    except (ValueError, IndexError, OSError):
        return True
    return not (young and _pid_alive(pid))  # the instant between its creation and its flock


def reap_dead_arenas(*dirs: str) -> list[str]:
    """Unlink the arenas (and location indexes) of MP servers that are gone, whatever their
    id: they are RAM until reboot. Run by every starting server and by the controller, over
    /dev/shm and any hugetlbfs mount (an arena may live there, its index in /dev/shm)."""
    dirs = list(dict.fromkeys([*dirs, *placement.hugetlbfs_mounts()]))
    found = [p for d in dirs for p in glob.glob(os.path.join(d, ARENA_GLOB))]
    arenas = [p for p in found if not p.endswith(".idx")]
    dead = [p for p in arenas if _owner_dead(p)]
    live = {os.path.basename(p) for p in arenas if p not in dead}
    doomed = dead + [p for p in found if p.endswith(".idx") and os.path.basename(p)[:-4] not in live]
    removed = []
    for p in doomed:
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass  # gone already, or another user's
    return removed


class Arena:
    """Shared-memory arena: blocks of (header, value) handed out by an `Allocator`.

    `huge_pages`: "auto" (hugetlbfs if mounted with room, else THP advice on the mapping),
    "off", or "on" (like auto, but fail if no page of the arena ends up huge). `numa_node`:
    "auto" (this CPU's node where there are several), "off", or a node number."""

    def __init__(self, nbytes: int, path: str | None = None, huge_pages: str = "auto", numa_node="auto"):
        self.size = round_up(nbytes)
        self.lock_fd = None
        self.placement = {"huge_pages_advised": False, "numa_node": None, "hugetlbfs": False}
        if path:
            tlb = placement.hugetlbfs_dir(self.size) if huge_pages != "off" else None
            if tlb is not None:
                path = os.path.join(tlb[0], os.path.basename(path))
                self.size = round_up(self.size, tlb[1])
            # Held for the life of the process (the kernel drops it when we die, even on
            # kill -9): same-host readers and reapers test it to tell a dead server's memory.
            self.lock_fd, self.mm = create_mapping(path, self.size, lock=True, populate=False)
            self.placement.update(placement.place(self.mm, huge_pages, placement.choose_node(numa_node)),
                                  hugetlbfs=tlb is not None)
        else:
            self.mm = mmap.mmap(-1, self.size)
        self.path = path
        self.buf = memoryview(self.mm)
        self.alloc = Allocator(self.size)
        if huge_pages == "on" and self.huge_page_bytes() == 0:
            self.close()
            raise OSError("--huge-pages on: no page of the arena is a huge page here (no hugetlbfs mount with free "
                          "pages, and transparent_hugepage/shmem_enabled is 'never'); use --huge-pages auto")

    def huge_page_bytes(self) -> int:
        return placement.huge_page_bytes(self.path) if self.path else 0

    def allocate(self, value_len: int) -> int | None:
        return self.alloc.alloc(HEADER_BYTES + value_len)

    def data(self, off: int, length: int) -> memoryview:
        return self.buf[off + HEADER_BYTES : off + HEADER_BYTES + length]

    def publish(self, off: int, token: int, length: int, check: int = 0) -> None:
        BLOCK_HEADER.pack_into(self.buf, off, token, length, check)

    def release(self, off: int) -> None:
        """Invalidate the header (readers notice), then give the space back."""
        BLOCK_HEADER.pack_into(self.buf, off, 0, 0, 0)
        self.alloc.free(off)

    def close(self, unlink: bool = True) -> None:
        drop_mapping(self.mm, self.buf, self.path if unlink else None)
        if self.lock_fd is not None:
            os.close(self.lock_fd)


class ArenaReader:
    """A same-host client's read-only view of a server's arena."""

    def __init__(self, path: str):
        self.fd, self.mm = open_mapping(path)
        self.buf = memoryview(self.mm)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            self.close()

    def server_alive(self) -> bool:
        """False once the server process is gone: its lock on the arena file is released."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def read_into(self, off: int, token: int, length: int, check: int, out: memoryview) -> bool:
        """Copy the value at `off` into `out`; False if the block is not (or no longer) that
        object (then ask the server)."""
        head = (token, length, check)
        try:
            if off + HEADER_BYTES + length > len(self.buf) or BLOCK_HEADER.unpack_from(self.buf, off) != head:
                return False
            out[:length] = self.buf[off + HEADER_BYTES : off + HEADER_BYTES + length]
            return BLOCK_HEADER.unpack_from(self.buf, off) == head
        except ValueError:
            return False  # closed by another thread (view change): take the RPC path

    def read_bytes(self, off: int, token: int, length: int, check: int) -> bytes | None:
        """The value at `off` as a new bytes object (one copy, out of shared memory)."""
        head = (token, length, check)
        try:
            if off + HEADER_BYTES + length > len(self.buf) or BLOCK_HEADER.unpack_from(self.buf, off) != head:
                return None
            data = bytes(self.buf[off + HEADER_BYTES : off + HEADER_BYTES + length])
            return data if BLOCK_HEADER.unpack_from(self.buf, off) == head else None
        except ValueError:
            return None  # closed by another thread (view change): take the RPC path

    def close(self) -> None:
        drop_mapping(self.mm, self.buf)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
