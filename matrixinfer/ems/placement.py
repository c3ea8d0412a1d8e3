"""Where the DRAM arena's memory lives: huge pages and the NUMA node (paper: the EMS pool is
huge-page backed and NUMA-aware).

Huge pages: a hugetlbfs mount with enough free pages takes the arena file (every page is a
huge page); otherwise the tmpfs mapping is advised MADV_HUGEPAGE, which the kernel honours
when /sys/kernel/mm/transparent_hugepage/shmem_enabled allows it (advise, within_size or
always) and ignores otherwise. Either way the server reports how many bytes of its arena
really are huge pages (from /proc/self/smaps), so a machine that allows none says so.

NUMA: with several nodes the arena's pages are preferred on the node of the CPU the server
starts on (mbind MPOL_PREFERRED before the pages are faulted in); on one node nothing is done.
Everything here falls back to plain 4 KiB pages, never to an error, unless asked for "on".
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import platform

MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels: the pages are touched instead
MPOL_PREFERRED = 1
SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(platform.machine())


def numa_nodes() -> list[int]:
    return sorted(int(p.rsplit("node", 1)[1]) for p in glob.glob("/sys/devices/system/node/node[0-9]*"))


def _cpulist(text: str) -> set[int]:
    cpus = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def current_node() -> int | None:
    """The NUMA node of the CPU this process runs on now (None if unknown)."""
    try:
        with open("/proc/self/stat") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: the last CPU run on
        for node in numa_nodes():
            with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
                if cpu in _cpulist(f.read()):
                    return node
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose_node(numa_node: str | int | None) -> int | None:
    """'auto': this CPU's node where there are several nodes, else None; an int: that node."""
    if numa_node in (None, "off"):
        return None
    if numa_node == "auto":
        return current_node() if len(numa_nodes()) > 1 else None
    return int(numa_node)


def mbind_preferred(mm: mmap.mmap, node: int) -> bool:
    """Prefer `node` for the (not yet faulted) pages of `mm`. False where the kernel says no."""
    if SYS_MBIND is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    rc = libc.syscall(SYS_MBIND, ctypes.c_void_p(addr), ctypes.c_ulong(len(mm)), MPOL_PREFERRED, mask,
                      ctypes.c_ulong(len(mask) * bits + 1), 0)
    return rc == 0


def hugetlbfs_mounts() -> list[str]:
    try:
        with open("/proc/mounts") as f:
            return [line.split()[1] for line in f if line.split()[2:3] == ["hugetlbfs"]]
    except OSError:
        return []


def hugetlbfs_dir(nbytes: int) -> tuple[str, int] | None:
    """(a writable hugetlbfs mount with enough free huge pages for `nbytes`, page size), if any."""
    mounts = [m for m in hugetlbfs_mounts() if os.access(m, os.W_OK)]
    if not mounts:
        return None
    try:
        with open("/proc/meminfo") as f:
            info = {k: v.split() for k, v in (line.split(":", 1) for line in f)}
        free, page = int(info["HugePages_Free"][0]), int(info["Hugepagesize"][0]) << 10
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return (mounts[0], page) if free * page >= nbytes else None


def huge_page_bytes(path: str) -> int:
    """Bytes of this process's mapping(s) of `path` backed by huge pages (THP or hugetlbfs)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    inside = line.rstrip("\n").endswith(path)
                elif inside and head[0] in ("ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:", "Private_Hugetlb:"):
                    total += int(head[1]) << 10
    except OSError:
        return 0
    return total


def populate(mm: mmap.mmap) -> None:
    """Fault every page in now (the arena is allocated up front, as the paper's pinned pool)."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError:
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 0, len(mm))


def place(mm: mmap.mmap, huge_pages: str, node: int | None) -> dict:
    """Advise huge pages, prefer a NUMA node, then fault the mapping in; what was asked for."""
    advised = False
    if huge_pages != "off" and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except OSError:
            pass
    bound = node is not None and mbind_preferred(mm, node)
    populate(mm)
    return {"huge_pages_advised": advised, "numa_node": node if bound else None}
