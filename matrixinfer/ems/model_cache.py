"""Model cache: N instances load one checkpoint; it is read from slow storage once.

The checkpoint's files are cut into chunks (4 MiB) stored in EMS under keys derived from the
model id, so they spread over all MP servers and load in parallel. The first loader to ask
for a missing chunk takes a lease on it and copies it from the source; the others wait for
it to appear and read it from the pool: the pool holds one copy however many instances load.

The source is a directory read at a capped bandwidth (the stand-in for object storage); a
`SourceServer` process shares one bandwidth cap among all its readers, like a bucket would.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .client import EMSClient
from .protocol import Connection, EMSError, RPCServer, drain, parse_addr, serve_until_signal

CHUNK = 4 << 20
MODEL_NAMESPACE = "models"  # where the engine's workers (load_format ems) keep checkpoints
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class Throttle:
    """Token bucket shared by every reader of one source (thread-safe)."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            start = max(self.next_free, time.monotonic())
            self.next_free = start + n / self.rate
        delay = self.next_free - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ThrottledSource:
    """A local checkpoint directory read at a capped bandwidth."""

    def __init__(self, root: str, bytes_per_s: float = 0.0):
        if not os.path.isdir(root):
            raise EMSError(f"model directory not found: {root}")
        self.root, self.throttle = root, Throttle(bytes_per_s)
        self.bytes_read = 0

    def files(self) -> dict[str, int]:
        return {f: os.path.getsize(os.path.join(self.root, f)) for f in sorted(os.listdir(self.root)) if os.path.isfile(os.path.join(self.root, f))}

    def read(self, name: str, offset: int, length: int) -> bytes:
        if os.sep in name or name.startswith("."):
            raise EMSError(f"bad file name {name!r}")
        self.throttle.take(length)
        with open(os.path.join(self.root, name), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        self.bytes_read += len(data)
        return data


class RemoteSource:
    """Client of a SourceServer: the same interface as ThrottledSource."""

    def __init__(self, addr: str):
        self.conn_addr = parse_addr(addr)
        self.local = threading.local()

    def _conn(self) -> Connection:
        if not hasattr(self.local, "conn"):
            self.local.conn = Connection(self.conn_addr, 60.0)
        return self.local.conn

    def files(self) -> dict[str, int]:
        return self._conn().call({"op": "files"})[0]["files"]

    def read(self, name: str, offset: int, length: int) -> bytes:
        return bytes(self._conn().call({"op": "read", "name": name, "offset": offset, "length": length})[1])

    @property
    def bytes_read(self) -> int:
        return self._conn().call({"op": "stats"})[0]["bytes_read"]


class SourceServer:
    """Serves a ThrottledSource over TCP; all connections share its bandwidth cap."""

    def __init__(self, root: str, bytes_per_s: float, host: str = "127.0.0.1", port: int = 0):
        self.source = ThrottledSource(root, bytes_per_s)
        self.rpc = RPCServer(host, port, self.handle)

    def handle(self, h, plen, sock):
        drain(sock, plen)
        if h.get("op") == "files":
            return {"ok": True, "files": self.source.files()}, []
        if h.get("op") == "stats":
            return {"ok": True, "bytes_read": self.source.bytes_read}, []
        if h.get("op") == "read":
            return {"ok": True}, [self.source.read(str(h["name"]), int(h["offset"]), int(h["length"]))]
        raise EMSError(f"unknown op {h.get('op')!r}")


def run_source_server(root: str, bytes_per_s: float, port: int = 0) -> int:
    srv = SourceServer(root, bytes_per_s, port=port)
    print(f"READY {srv.rpc.host}:{srv.rpc.port}", flush=True)
    return serve_until_signal(srv.rpc.serve_forever, srv.rpc.close)


# -- loading --------------------------------------------------------------------------------------


def model_id_of(files: dict[str, int], name: str = "") -> str:
    """Identity of a checkpoint: its file names and sizes (a new upload gets a new id)."""
    return hashlib.sha1(json.dumps([name, sorted(files.items())]).encode()).hexdigest()[:16]


def chunks(files: dict[str, int]) -> list[tuple[str, int, int]]:
    return [(f, off, min(CHUNK, size - off)) for f, size in files.items() for off in range(0, size, CHUNK)]


@dataclass
class LoadReport:
    seconds: float
    bytes_total: int
    bytes_from_source: int  # read from the source by this loader
    bytes_from_pool: int  # read from EMS by this loader


class ModelCache:
    def __init__(self, client: EMSClient, source, model_name: str = "", lease_ttl_s: float = 30.0):
        self.client, self.source, self.lease_ttl_s = client, source, lease_ttl_s
        self.files = source.files()
        self.model_id = model_id_of(self.files, model_name)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="model-cache")

    def key(self, name: str, offset: int) -> str:
        return f"model/{self.model_id}/{name}@{offset}"

    def fetch(self) -> tuple[dict[str, bytearray], LoadReport]:
        """Every file of the checkpoint as a bytearray, filled from the pool (or the source once)."""
        t0 = time.perf_counter()
        bufs = {f: bytearray(n) for f, n in self.files.items()}
        pending = chunks(self.files)
        from_source = from_pool = 0
        while pending:
            results = list(self._pool.map(lambda c: self._one(bufs, *c), pending))
            from_source += sum(n for how, n in results if how == "source")
            from_pool += sum(n for how, n in results if how == "pool")
            pending = [c for c, (how, _) in zip(pending, results) if how == "wait"]
            if pending:
                time.sleep(0.02)  # another instance is filling these chunks
        report = LoadReport(time.perf_counter() - t0, sum(self.files.values()), from_source, from_pool)
        return bufs, report

    def _one(self, bufs, name: str, offset: int, length: int) -> tuple[str, int]:
        dst = memoryview(bufs[name])[offset : offset + length]
        key = self.key(name, offset)
        if self.client.get_into(key, dst) == length:
            return "pool", length
        leased = self.client.lease(key, self.lease_ttl_s)
        if leased is None:  # its MP server is unreachable: the pool cannot help, read the source
            return self._from_source(dst, name, offset, length, put=False)
        if not leased:
            return "wait", 0  # another instance is filling it
        return self._from_source(dst, name, offset, length, put=True, key=key)

    def _from_source(self, dst, name, offset, length, put, key=None) -> tuple[str, int]:
        dst[:] = self.source.read(name, offset, length)
        if put:
            self.client.put(key, dst)
        return "source", length

    def load(self) -> tuple[dict, LoadReport]:
        """Tensors of every *.safetensors file (views into the fetched buffers: no extra copy)."""
        bufs, report = self.fetch()
        tensors = {}
        for name, buf in bufs.items():
            if name.endswith(".safetensors"):
                tensors.update(tensors_from_safetensors(buf))
        return tensors, report

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def tensors_from_safetensors(buf: bytearray) -> dict:
    import torch

    (hlen,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(bytes(buf[8 : 8 + hlen]))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = getattr(torch, ST_DTYPES[meta["dtype"]])
        t = torch.frombuffer(buf, dtype=torch.uint8, count=end - start, offset=8 + hlen + start) if end > start else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(meta["shape"])
    return out


def load_direct(source) -> tuple[dict[str, bytearray], LoadReport]:
    """The baseline: every instance reads the whole checkpoint from the source itself."""
    t0 = time.perf_counter()
    files = source.files()
    bufs = {f: bytearray(n) for f, n in files.items()}

    def one(c):
        name, off, n = c
        memoryview(bufs[name])[off : off + n] = source.read(name, off, n)

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, chunks(files)))
    total = sum(files.values())
    return bufs, LoadReport(time.perf_counter() - t0, total, total, 0)


def load_model_cli(args) -> int:
    source = RemoteSource(args.source) if args.source else ThrottledSource(args.model, args.bandwidth_mbps * 1e6)
    if args.wait_go:  # benchmark: N loader processes start together once all are ready
        import torch  # noqa: F401  (imported before the clock starts, as a serving instance would)

        print("ARMED", flush=True)
        sys.stdin.readline()
    if args.direct:
        _, report = load_direct(source)
    else:
        with EMSClient(args.controller, args.namespace) as client:
            mc = ModelCache(client, source, model_name=args.model or "")
            tensors, report = mc.load()
            mc.close()
    print(json.dumps({"model": args.model, "end": time.time(), **vars(report)}), flush=True)
    return 0
