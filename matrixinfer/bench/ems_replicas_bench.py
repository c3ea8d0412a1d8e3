"""`matrixinfer bench ems --replicas N`: what N copies cost and buy, side by side with one copy
on the same pool in the same run.

One pool of max(3, N + 1) MP servers (durable puts, fsync), two namespaces: replicas 1 and N.
For 64 KiB and 1 MiB values, in alternating rounds: put and put_many(16) latency (p50/p99)
and throughput (median round), same-host get, and the pool bytes each namespace takes per
byte stored. Then one server is SIGKILLed: the
misses each namespace sees right after, the time until the survivors have re-replicated
(from the kill: the controller's heartbeat timeout plus the pass) and the bytes they moved.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np

from matrixinfer.bench.report import markdown_table, save_json

from matrixinfer.bench.ems_bench import _timed
from matrixinfer.ems.client import EMSClient
from matrixinfer.ems.local import LocalCluster

SIZES = [64 << 10, 1 << 20]
BATCH = 16


def _p(lat: list[float], q: float) -> float:
    return float(np.percentile(np.array(lat) * 1e6, q))


def _write_read(c: EMSClient, tag: str, size: int, total: int, cells: dict) -> list[str]:
    """One round of put / put_many / get for one namespace and size; samples into `cells`."""
    n = max(BATCH, total // size // BATCH * BATCH)
    val = os.urandom(size)
    keys = [f"{tag}-{size}-{i}" for i in range(n)]
    batch_keys = [f"{tag}-{size}-b{i}" for i in range(n)]
    batches = [batch_keys[i : i + BATCH] for i in range(0, n, BATCH)]
    for op, fn, items in (("put", lambda k: c.put(k, val), keys),
                          (f"put_many({BATCH})", lambda b: c.put_many([(k, val) for k in b]), batches),
                          ("get (same host)", c.get, keys)):
        secs, lat = _timed(fn, items)
        cell = cells.setdefault((c.replicas, size, op), {"MBps": [], "lat": []})
        cell["MBps"].append(n * size / secs / 1e6)
        cell["lat"] += lat
    assert c.get(keys[-1]) == val and c.get(batch_keys[0]) == val
    return keys + batch_keys


def run_replicas_bench(args) -> int:
    replicas = args.replicas
    n_servers = max(3, replicas + 1)
    total, rounds = ((4 << 20), 1) if args.quick else ((8 << 20), 3)
    root = tempfile.mkdtemp(prefix="ems-replicas-")
    # room for every copy of both namespaces (gets from DRAM, not SSD), with slack
    dram = 2 * (1 + replicas) * rounds * len(SIZES) * 2 * total // n_servers + (32 << 20)
    try:
        with LocalCluster(n_servers=n_servers, root=root, dram_bytes=dram) as cl:
            cl.wait_repaired(n_servers)  # start-up passes done: nothing else loads the pool
            clients = {r: EMSClient(cl.controller, f"rep{r}", replicas=r) for r in (1, replicas)}
            cells, keys, stored = {}, {}, {}
            for rnd in range(rounds):  # the two namespaces alternate, so the disk's moods hit both
                for size in SIZES:
                    for r, c in clients.items():
                        ks = _write_read(c, f"r{rnd}", size, total, cells)
                        keys.setdefault(r, []).extend(ks)
                        stored[r] = stored.get(r, 0) + len(ks) * size
            rows = [{"replicas": r, "value_bytes": size, "op": op, "MBps": float(np.median(v["MBps"])),
                     "p50_us": _p(v["lat"], 50), "p99_us": _p(v["lat"], 99)} for (r, size, op), v in cells.items()]
            st = clients[1].stats()
            pool_bytes = {r: sum(s["ns_ssd_bytes"].get(f"rep{r}", 0) for s in st.values()) for r in clients}
            t_kill = time.monotonic()
            cl.kill_server(0)
            time.sleep(0.15)  # past the same-host readers' liveness check
            misses = {r: sum(v is None for v in c.get_many(keys[r])) for r, c in clients.items()}
            st = cl.wait_repaired(n_servers - 1, timeout_s=120.0)
            healed_s = time.monotonic() - t_kill
            moved = {"objects": sum(s["repair"]["objects"] for s in st.values()),
                     "bytes": sum(s["repair"]["bytes"] for s in st.values()),
                     "pass_seconds": max(s["repair"]["last_seconds"] for s in st.values())}
            for c in clients.values():
                c.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fail = [{"replicas": r, "objects": len(keys[r]), "misses after kill -9": misses[r],
             "pool bytes / stored bytes": pool_bytes[r] / stored[r]} for r in clients]
    data = {"rows": rows, "failure": fail, "rereplication": {**moved, "seconds_from_kill": healed_s},
            "config": {"servers": n_servers, "replicas": replicas, "bytes_per_cell": total, "rounds": rounds, "fsync": "always",
                       "heartbeat_timeout_s": LocalCluster.heartbeat_timeout_s, "cpus": os.cpu_count(), "quick": args.quick}}
    save_json(f"{args.name}-replicas", data)
    table = [[r["replicas"], f"{r['value_bytes'] >> 10} KiB", r["op"], r["MBps"], r["p50_us"], r["p99_us"]] for r in rows]
    print(markdown_table(["replicas", "value", "op", "MB/s", "p50 us", "p99 us"], table))
    print()
    print(markdown_table(list(fail[0]), [list(f.values()) for f in fail]))
    print(f"\nre-replication after kill -9 of 1 of {n_servers} servers: {moved['objects']} objects, "
          f"{moved['bytes'] / 1e6:.1f} MB moved; {healed_s:.2f} s from the kill (heartbeat timeout "
          f"{LocalCluster.heartbeat_timeout_s} s), the pass itself {moved['pass_seconds']:.2f} s")
    return 0
