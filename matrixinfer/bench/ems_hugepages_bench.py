"""`matrixinfer bench ems --huge-pages`: the same-host get path with the arena on huge pages
and without.

Two one-server pools, `--huge-pages off` and `--huge-pages auto`; each reports how many of
its arena's bytes the kernel really backed with huge pages (a machine whose tmpfs allows no
transparent huge pages and has no hugetlbfs pages gives none, and says so). Then `get_into`
of random keys (64 KiB..4 MiB) from one same-host client, p50/p99 per size. A last pair of
rows copies out of a private anonymous mapping with and without MADV_HUGEPAGE (allowed by
`transparent_hugepage/enabled=madvise` where shmem THP is not): what huge pages do to the
copy itself, separately from whether the arena can get them.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import tempfile
import time

from matrixinfer.bench.report import markdown_table, save_json

from matrixinfer.ems.client import EMSClient
from matrixinfer.ems.local import LocalCluster

SIZES = [64 << 10, 1 << 20, 4 << 20]
ARENA = 512 << 20


def _percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def _arena_rows(mode: str, root: str, gets: int) -> list[list]:
    rows = []
    with LocalCluster(n_servers=1, root=os.path.join(root, mode), dram_bytes=ARENA, huge_pages=mode) as cl:
        c = EMSClient(cl.controller, "hp")
        huge = next(iter(c.stats().values()))["arena"]["huge_page_bytes"]
        rng = random.Random(0)
        for size in SIZES:
            keys = [f"{size}-{i}" for i in range(min(64, (ARENA // 2) // size))]
            assert all(c.put_many([(k, os.urandom(size)) for k in keys]))
            out, lat = bytearray(size), []
            for _ in range(gets):
                k = rng.choice(keys)
                t = time.perf_counter()
                assert c.get_into(k, out) == size
                lat.append(time.perf_counter() - t)
            rows.append([f"arena, --huge-pages {mode}", huge >> 20, f"{size >> 10} KiB", *_percentiles(lat)])
        c.close()
    return rows


def _anon_rows(gets: int) -> list[list]:
    rows = []
    for advise in (False, True):
        mm = mmap.mmap(-1, ARENA, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if advise:
            mm.madvise(mmap.MADV_HUGEPAGE)
        mm.write(b"\1" * ARENA)  # fault it in (as the arena is)
        with open("/proc/self/smaps_rollup") as f:
            anon_huge = next(int(line.split()[1]) << 10 for line in f if line.startswith("AnonHugePages"))
        view, rng = memoryview(mm), random.Random(1)
        for size in SIZES:
            out, lat = bytearray(size), []
            for _ in range(gets):
                off = rng.randrange(0, ARENA - size) & ~63
                t = time.perf_counter()
                out[:] = view[off:off + size]
                lat.append(time.perf_counter() - t)
            rows.append([f"anonymous mapping, MADV_HUGEPAGE {'on' if advise else 'off'}", anon_huge >> 20,
                         f"{size >> 10} KiB", *_percentiles(lat)])
        view.release()
        mm.close()
    return rows


def run_hugepages_bench(args) -> int:
    gets = 300 if args.quick else 2000
    root = tempfile.mkdtemp(prefix="ems-hp-")
    try:
        rows = _arena_rows("off", root, gets) + _arena_rows("auto", root, gets) + _anon_rows(gets)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        shmem = f.read().strip()
    headers = ["memory", "huge MiB", "value", "p50 us", "p99 us"]
    save_json("ems-hugepages", {"rows": [dict(zip(headers, r)) for r in rows], "shmem_enabled": shmem,
                                "gets_per_cell": gets, "cpus": os.cpu_count()})
    print(f"transparent_hugepage/shmem_enabled: {shmem}\n")
    print(markdown_table(headers, rows))
    return 0
