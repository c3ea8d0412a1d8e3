"""`matrixinfer bench ems`: EMS against a real Redis on loopback, and the model cache.

1. put/get throughput and latency for 64 KiB..4 MiB values on 1, 2 and 4 MP servers, on the
   same-host zero-copy path and the TCP path, next to redis-server doing the same work (SET,
   GET, and MGET for batches) in the same run.
2. Model cache: N = 1, 2, 4 instances load one checkpoint at once from a bandwidth-capped
   source, directly vs through EMS: time, bytes read from the source, DRAM used.

Results: <out>/ems.json, <out>/ems.png, section "ems" of <out>/BENCHMARKS.md (see
bench/report.py: --out, --save). `--huge-pages` instead measures the same-host get path with
the arena on huge pages and without (ems_hugepages_bench.py); `--replicas N` what N copies of
each object cost next to one (ems_replicas_bench.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section

from matrixinfer.ems.client import EMSClient
from matrixinfer.ems.local import LocalCluster

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
BATCH = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on loopback, no persistence (its default for a cache), started here."""

    def __init__(self, workdir: str):
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("bench ems needs redis-server on PATH (Debian: apt-get install -y redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", workdir, "--maxmemory", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        for _ in range(100):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.close()
        raise SystemExit("redis-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _timed(fn, items) -> tuple[float, list[float]]:
    lat, t0 = [], time.perf_counter()
    for it in items:
        t = time.perf_counter()
        fn(it)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0, lat


class Recorder:
    """Collects rounds of one (servers, size, path, op) cell; reports the median round."""

    def __init__(self):
        self.cells: dict[tuple, list] = {}

    def run(self, servers, size, path, op, nbytes, fn, items) -> None:
        seconds, lat = _timed(fn, items)
        self.cells.setdefault((servers, size, path, op), []).append((nbytes / seconds / 1e6, lat))

    def rows(self) -> list[dict]:
        out = []
        for (servers, size, path, op), rounds in self.cells.items():
            lat_us = np.array([x for _, lat in rounds for x in lat]) * 1e6
            out.append({"servers": servers, "value_bytes": size, "path": path, "op": op,
                        "MBps": float(np.median([m for m, _ in rounds])), "rounds": len(rounds),
                        "p50_us": float(np.percentile(lat_us, 50)), "p99_us": float(np.percentile(lat_us, 99))})
        return out


def _count(size: int, total: int) -> int:
    return max(BATCH, total // size // BATCH * BATCH)


def _workload(size: int, total: int, tag: str):
    n = _count(size, total)
    keys = [f"{tag}-{size}-{i}" for i in range(n)]
    return os.urandom(size), keys, [keys[i : i + BATCH] for i in range(0, n, BATCH)], n * size


def bench_kv(rec: Recorder, n_servers: int, sizes: list[int], total: int, rounds: int, root: str, bar, fsync: str = "always") -> None:
    dram = max(256 << 20, 2 * rounds * total // n_servers + (64 << 20))
    label = "" if fsync == "always" else f" (fsync={fsync})"
    with LocalCluster(n_servers=n_servers, root=os.path.join(root, f"kv{n_servers}{fsync}"), dram_bytes=dram, fsync=fsync) as cl:
        shm = EMSClient(cl.controller, "bench")
        tcp = EMSClient(cl.controller, "bench", zero_copy=False)
        for size in sizes:
            out = bytearray(size)
            for r in range(rounds):
                val, keys, batches, nbytes = _workload(size, total, f"r{r}")
                rec.run(n_servers, size, "ems" + label, "put", nbytes, lambda k: shm.put(k, val), keys)
                val, keys, batches, nbytes = _workload(size, total, f"b{r}")
                rec.run(n_servers, size, "ems" + label, f"put_many({BATCH})", nbytes, lambda b: shm.put_many([(k, val) for k in b]), batches)
                if fsync != "always":
                    continue  # the read paths do not depend on the fsync policy
                for path, c in (("ems-shm", shm), ("ems-tcp", tcp)):
                    rec.run(n_servers, size, path, "get", nbytes, c.get, keys)
                    rec.run(n_servers, size, path, f"get_many({BATCH})", nbytes, c.get_many, batches)
                rec.run(n_servers, size, "ems-shm", "get_into (reused buffer)", nbytes, lambda k: shm.get_into(k, out), keys)
                assert shm.get(keys[-1]) == val and tcp.get(keys[0]) == val
            bar.update(1)
        shm.close()
        tcp.close()


def bench_redis(rec: Recorder, sizes: list[int], total: int, rounds: int, root: str, bar) -> None:
    r = RedisServer(root)
    try:
        c = r.client
        for size in sizes:
            for rnd in range(rounds):
                val, keys, batches, nbytes = _workload(size, total, f"r{rnd}")
                rec.run(1, size, "redis", "put", nbytes, lambda k: c.set(k, val), keys)
                rec.run(1, size, "redis", "get", nbytes, c.get, keys)
                rec.run(1, size, "redis", f"get_many({BATCH})", nbytes, c.mget, batches)
                val, keys, batches, nbytes = _workload(size, total, f"b{rnd}")
                rec.run(1, size, "redis", f"put_many({BATCH})", nbytes, lambda b: c.mset({k: val for k in b}), batches)
                assert c.get(keys[-1]) == val
                c.flushall()
            bar.update(1)
    finally:
        r.close()


def _write_checkpoint(path: str, nbytes: int) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    per = nbytes // 8 // 4
    save_file({f"layers.{i}.weight": torch.randn(per) for i in range(8)}, os.path.join(path, "model.safetensors"))


def bench_model_cache(root: str, model_bytes: int, mbps: float, rounds: int, bar) -> list[dict]:
    ckpt = os.path.join(root, "ckpt")
    _write_checkpoint(ckpt, model_bytes)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    rows = []
    with LocalCluster(n_servers=2, root=os.path.join(root, "mc"), dram_bytes=size + (64 << 20)) as cl:
        src = cl._spawn(["source", "--model", ckpt, "--bandwidth-mbps", str(mbps)], "source.log")
        try:
            from matrixinfer.ems.model_cache import RemoteSource

            source = RemoteSource(src.addr)
            admin = EMSClient(cl.controller, "admin")
            cells: dict[tuple, list] = {}
            for rnd in range(rounds):
                for n in (1, 2, 4):
                    for mode in ("direct", "ems-cold", "ems-warm"):
                        ns = f"mc{n}-{rnd}"  # a fresh (cold) pool namespace per round
                        before = source.bytes_read
                        args = ["--source", src.addr] + (["--direct"] if mode == "direct" else ["--controller", cl.controller, "--namespace", ns])
                        reports, seconds = _run_loaders(n, args)
                        stats = admin.stats()
                        pool = sum(s["ns_dram_bytes"].get(ns, 0) for s in stats.values()) if mode != "direct" else 0
                        cells.setdefault((n, mode), []).append((seconds, source.bytes_read - before, pool))
                        bar.update(1)
            for (n, mode), runs in cells.items():
                seconds, src_bytes, pool = sorted(runs)[len(runs) // 2]  # the median round
                rows.append({"instances": n, "mode": mode, "seconds": seconds, "seconds_all": [r[0] for r in runs],
                             "model_bytes": size, "source_bytes": src_bytes, "pool_dram_bytes": pool,
                             "host_dram_bytes": pool + n * size})  # + each instance's own loaded copy
        finally:
            src.popen.terminate()
            src.popen.wait(10)
    return rows


def _run_loaders(n: int, args: list[str]) -> tuple[list[dict], float]:
    """N loader processes; each imports and connects, then all start on one signal.
    Returns their reports and the time from the signal until the last one finished."""
    procs = [subprocess.Popen([sys.executable, "-m", "matrixinfer.ems", "model-load", *args, "--wait-go"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        if p.stdout.readline().strip() != "ARMED":
            raise RuntimeError("model-load did not start")
    go = time.time()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"model-load failed ({p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out, max(r["end"] for r in out) - go


def _plot(kv: list[dict], mc: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r["value_bytes"] for r in kv})
    nmax = max(r["servers"] for r in kv)
    for path_, servers, style in (("ems-shm", 1, "o-"), ("ems-shm", nmax, "o--"), ("ems-tcp", 1, "s-"), ("redis", 1, "^-")):
        ys = [next((r["MBps"] for r in kv if r["path"] == path_ and r["servers"] == servers and r["op"] == "get" and r["value_bytes"] == s), np.nan) for s in sizes]
        a.plot([s >> 10 for s in sizes], ys, style, label=f"{path_} ({servers} server{'s' * (servers > 1)})")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("value size (KiB)")
    a.set_ylabel("single-client get throughput (MB/s)")
    a.set_title("EMS vs Redis, loopback")
    a.legend()
    for mode, style in (("direct", "o-"), ("ems-cold", "s-"), ("ems-warm", "^-")):
        pts = [(r["instances"], r["seconds"]) for r in mc if r["mode"] == mode]
        b.plot(*zip(*pts), style, label=mode)
    b.set_xticks([1, 2, 4])
    b.set_xlabel("instances loading concurrently")
    b.set_ylabel("time to load (s)")
    b.set_title("Model cache vs direct load from a capped source")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ratios(kv: list[dict]) -> list[list]:
    """EMS throughput / Redis throughput for the same operation and value size."""
    red = {(r["value_bytes"], r["op"]): r["MBps"] for r in kv if r["path"] == "redis"}
    red.update({(s, "get_into (reused buffer)"): m for (s, op), m in list(red.items()) if op == "get"})
    return [[r["servers"], f"{r['value_bytes'] >> 10} KiB", r["path"], r["op"], r["MBps"] / red[(r["value_bytes"], r["op"])]]
            for r in kv if r["path"] != "redis"]


def _pivot(kv: list[dict], ops: list[str], cols: list[tuple[str, int]], ratio_of: tuple[str, int] | None) -> str:
    cell = {(r["path"], r["servers"], r["value_bytes"], r["op"]): r["MBps"] for r in kv}
    heads = ["value", "op"] + [f"{p} x{n}" if p != "redis" else "redis" for p, n in cols]
    rows = []
    for size in sorted({r["value_bytes"] for r in kv}):
        for op in ops:
            vals = [cell.get((p, n, size, op), "-") for p, n in cols]
            row = [f"{size >> 10} KiB", op, *vals]
            if ratio_of:
                row.append(cell.get((*ratio_of, size, op), float("nan")) / cell.get(("redis", 1, size, op if op in ("get", f"get_many({BATCH})") else "get"), float("nan")))
            rows.append(row)
    if ratio_of:
        heads.append(f"{ratio_of[0]} x{ratio_of[1]} / redis")
    return markdown_table(heads, rows)


def _markdown(kv: list[dict], mc: list[dict], cfg: dict, out: str) -> str:
    servers = cfg["servers"]
    gets = [("redis", 1)] + [("ems-shm", n) for n in servers] + [("ems-tcp", n) for n in servers]
    puts = [("redis", 1)] + [("ems", n) for n in servers] + [("ems (fsync=never)", 1)]
    lat = [[f"{r['value_bytes'] >> 10} KiB", r["path"], r["p50_us"], r["p99_us"]]
           for r in sorted(kv, key=lambda r: (r["value_bytes"], r["path"])) if r["op"] == "get" and r["servers"] == 1]
    return "\n".join([
        f"## EMS (`matrixinfer bench ems{' --quick' if cfg['quick'] else ''}`)", "",
        f"One client process, loopback, {cfg['cpus']} CPUs shared by every process (and, when this ran, by other work on the "
        f"machine). Median of {cfg['rounds']} rounds of {cfg['bytes_per_cfg'] >> 20} MiB per cell. `ems-shm`: the client finds "
        "a value through the MP server's shared-memory index and copies it out of the server's arena (same host, no request "
        "to the server); `ems-tcp`: values stream over the socket. `xN`: N MP servers. Redis: redis-server 7 on loopback, no persistence, via redis-py "
        "(GET/MGET/SET/MSET). Raw numbers: `benchmarks/ems.json`.", "",
        "**Get throughput (MB/s)**", "",
        _pivot(kv, ["get", f"get_many({BATCH})", "get_into (reused buffer)"], gets, ("ems-shm", 1)), "",
        "`get_into` copies into a caller's preallocated buffer (how KV pages land in a KV cache); its ratio is against Redis GET.", "",
        "**Put throughput (MB/s).** EMS acknowledges a put only after fsync (group commit; one fsync per `put_many`); "
        "Redis keeps it in memory only. `fsync=never` is EMS acknowledging after write().", "",
        _pivot(kv, ["put", f"put_many({BATCH})"], puts, None), "",
        "**Single-get latency, 1 server (us)**", "",
        markdown_table(["value", "path", "p50", "p99"], lat), "",
        f"**Model cache.** A {cfg['model_bytes'] >> 20} MiB checkpoint; the source (object-storage stand-in) is capped at "
        f"{cfg['source_MBps']:.0f} MB/s shared by all its readers; 2 MP servers. N instances start together; time until the "
        f"last has every tensor (median of {cfg['rounds']} rounds). `ems-cold`: empty pool (one instance fills each chunk, the others wait for it); "
        "`ems-warm`: N new instances after that.", "",
        markdown_table(["instances", "mode", "seconds", "source MB read", "pool DRAM MB", "host DRAM MB (pool + instances)"],
                       [[r["instances"], r["mode"], r["seconds"], r["source_bytes"] / 1e6, r["pool_dram_bytes"] / 1e6, r["host_dram_bytes"] / 1e6] for r in mc]),
        "", f"![EMS benchmark]({out}.png)"])


def run_bench(args) -> int:
    quick = args.quick
    sizes = SIZES if not quick else [64 << 10, 1 << 20]
    servers = [1, 2, 4] if not quick else [1, 2]
    total, rounds = ((32 << 20), 3) if not quick else ((8 << 20), 1)
    model_bytes, mbps = ((128 << 20), 400.0) if not quick else ((16 << 20), 200.0)
    root = tempfile.mkdtemp(prefix="ems-bench-")
    t0 = time.time()
    rec = Recorder()
    try:
        with tqdm(total=len(sizes) * (len(servers) + 2), desc="ems put/get", unit="cfg") as bar:
            bench_redis(rec, sizes, total, rounds, root, bar)
            for n in servers:
                bench_kv(rec, n, sizes, total, rounds, root, bar)
            bench_kv(rec, 1, sizes, total, rounds, root, bar, fsync="never")
        kv = rec.rows()
        with tqdm(total=9 * rounds, desc="model cache", unit="run") as bar:
            mc = bench_model_cache(root, model_bytes, mbps, rounds, bar)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = _ratios(kv)
    data = {"kv": kv, "model_cache": mc, "ratios_vs_redis": ratios, "config": {"sizes": sizes, "servers": servers, "bytes_per_cfg": total,
            "batch": BATCH, "rounds": rounds, "model_bytes": model_bytes, "source_MBps": mbps, "cpus": os.cpu_count(), "quick": quick,
            "seconds": time.time() - t0}}
    save_json(args.name, data)
    png = str(bench_dir() / f"{args.name}.png")
    _plot(kv, mc, png)
    md = _markdown(kv, mc, data["config"], args.name)
    if args.name == "ems":  # another --name (e.g. a quick smoke run) leaves BENCHMARKS.md alone
        write_section("ems", md)
    print(md)
    return 0

