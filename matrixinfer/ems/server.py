"""The MP (memory-pool) server process: serves its shard over TCP and shared memory.

It registers with the controller, heartbeats, learns namespace quotas from it, and answers
clients directly: the controller never sees data. When the ring changes it re-replicates
what it holds to the holders that lack it (repair.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time

from .arena import Arena, reap_dead_arenas
from .repair import Repairer
from .config import ServerConfig
from .protocol import EMSError, RPCServer, call_once, drain, recv_exact_into, serve_until_signal, wire_key
from .shard import Quota, Shard
from .shmindex import ShmIndex, slots_for
from .ssd import SegmentLog
from .view import boot_id

MAX_BATCH = 4096


def server_id_for(cfg: ServerConfig) -> str:
    """Stable id (so a restarted server takes back its ring slot): stored in the SSD dir."""
    path = os.path.join(cfg.ssd_dir, "SERVER_ID")
    if cfg.server_id:
        sid = cfg.server_id
    elif os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    else:
        sid = "mp-" + hashlib.sha1(os.path.abspath(cfg.ssd_dir).encode()).hexdigest()[:10]
    with open(path, "w") as f:
        f.write(sid)
    return sid


def _ns(header: dict) -> str:
    ns = header.get("ns")
    if not isinstance(ns, str) or not ns or len(ns) > 255:
        raise EMSError("namespace must be a non-empty string of at most 255 characters")
    return ns


def _keys(header: dict) -> list[str]:
    keys = header.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_BATCH:
        raise EMSError(f"keys must be a list of at most {MAX_BATCH}")
    return [wire_key(k) for k in keys]


class MPServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        os.makedirs(cfg.ssd_dir, exist_ok=True)
        self.id = server_id_for(cfg)
        reap_dead_arenas(cfg.shm_dir)  # ours from a killed run, and any other dead server's
        name = f"mi-ems-{self.id}-{os.getpid()}"
        self.arena = Arena(cfg.dram_bytes, os.path.join(cfg.shm_dir, name), cfg.huge_pages, cfg.numa_node)
        self.shm_path = self.arena.path  # in a hugetlbfs mount when one has room
        self.shm_index = ShmIndex(os.path.join(cfg.shm_dir, name + ".idx"), slots_for(cfg.dram_bytes))
        self.shard = Shard(self.arena, SegmentLog(cfg.ssd_dir, cfg.segment_bytes, cfg.fsync), self.shm_index)
        self.rpc = RPCServer(cfg.host, cfg.port, self.handle)
        self.n_servers = 1
        self.ns_version = -1
        self.quota_path = os.path.join(cfg.ssd_dir, "QUOTAS.json")
        self._ns_lock = threading.Lock()
        self.repair = Repairer(self.id, self.shard, cfg.controller, lambda: self.namespaces)
        self._load_quotas()
        self._ns_asked: dict[str, float] = {}
        self._stop = threading.Event()

    # -- request handling ------------------------------------------------------------------------
    def handle(self, h: dict, plen: int, sock: socket.socket):
        if isinstance(h.get("ns"), str) and h["ns"] not in self.shard.quotas:
            self._fetch_namespace(h["ns"])  # created after our last heartbeat: learn its quota
        op = h.get("op")
        fn = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if fn is None:
            drain(sock, plen)
            raise EMSError(f"unknown op {op!r}")
        if op not in ("put", "put_many") and plen:
            drain(sock, plen)
            raise EMSError(f"op {op!r} takes no payload")
        return fn(h, plen, sock)

    def _recv_value(self, ns: str, key: str, length: int, sock: socket.socket):
        """Phase one of a put: a pending block filled from the socket (invisible until commit)."""
        try:
            blk = self.shard.begin_put(ns, key, length)
        except EMSError:
            drain(sock, length)
            raise
        try:
            recv_exact_into(sock, self.arena.data(blk.off, length))
        except BaseException:
            self.shard.abort_put(blk)
            raise
        return blk

    def op_put(self, h, plen, sock):
        ns, key = _ns(h), wire_key(h.get("key", ""))
        self.shard.commit_put(ns, key, self._recv_value(ns, key, plen, sock))
        return {"ok": True}, []

    def op_put_many(self, h, plen, sock):
        ns, keys, lens = _ns(h), _keys(h), h.get("lens")
        if not isinstance(lens, list) or len(lens) != len(keys) or sum(lens) != plen or min(lens, default=0) < 0:
            drain(sock, plen)
            raise EMSError("put_many: lens must match keys and the payload")
        filled = []
        try:
            for key, n in zip(keys, lens):
                try:
                    filled.append((key, self._recv_value(ns, key, n, sock)))
                except EMSError:
                    filled.append((key, None))  # payload drained; carry on with the rest
        except BaseException:
            for _, blk in filled:
                if blk is not None:
                    self.shard.abort_put(blk)
            raise
        self.shard.commit_many(ns, [(k, b) for k, b in filled if b is not None])
        return {"ok": True, "stored": [b is not None for _, b in filled]}, []

    def _read(self, ns: str, keys: list[str], shm: bool):
        """Per key: a location in the arena (same host) or a view to stream (TCP)."""
        locs, lens, views, pinned = [], [], [], []
        for key in keys:
            hit = self.shard.lookup(ns, key, pin=not shm)
            if hit is None:
                locs.append(None)
                lens.append(-1)
                continue
            blk, view = hit
            if shm and blk is not None:
                locs.append([blk.off, blk.length, blk.token, blk.check])
                lens.append(-1)
                continue
            locs.append(None)
            lens.append(len(view))
            views.append(view)
            if blk is not None and not shm:
                pinned.append(blk)

        def done():
            for b in pinned:
                self.shard.unpin(b)

        return locs, lens, views, done

    def op_get(self, h, plen, sock):
        ns, key = _ns(h), wire_key(h.get("key", ""))
        locs, lens, views, done = self._read(ns, [key], bool(h.get("shm")))
        return {"ok": True, "loc": locs[0], "len": lens[0]}, views, done

    def op_get_many(self, h, plen, sock):
        locs, lens, views, done = self._read(_ns(h), _keys(h), bool(h.get("shm")))
        return {"ok": True, "locs": locs, "lens": lens}, views, done

    def op_exists(self, h, plen, sock):
        ns = _ns(h)
        return {"ok": True, "found": [self.shard.exists(ns, k) for k in _keys(h)]}, []

    def op_touch(self, h, plen, sock):
        self.shard.touch(_ns(h), _keys(h))
        return {"ok": True}, []

    def op_delete(self, h, plen, sock):
        return {"ok": True, "deleted": self.shard.delete(_ns(h), wire_key(h.get("key", "")))}, []

    def op_lease(self, h, plen, sock):
        ttl = float(h.get("ttl_s", 30.0))
        got = self.shard.lease(_ns(h), wire_key(h.get("key", "")), ttl, time.monotonic())
        return {"ok": True, "acquired": got}, []

    def op_info(self, h, plen, sock):
        return {"ok": True, "id": self.id, "shm": self.shm_path, "boot_id": boot_id(), "pid": os.getpid()}, []

    def op_stats(self, h, plen, sock):
        st = self.shard.stats()
        st["arena"].update(self.arena.placement, huge_page_bytes=self.arena.huge_page_bytes())
        return {"ok": True, "id": self.id, "n_servers": self.n_servers, "repair": vars(self.repair.stats).copy(), **st}, []

    # -- membership ------------------------------------------------------------------------------
    def _member(self) -> dict:
        return {"id": self.id, "host": self.cfg.host, "port": self.rpc.port, "shm": self.shm_path, "idx": self.shm_index.path, "boot_id": boot_id()}

    def _apply(self, reply: dict) -> None:
        n_servers = max(1, int(reply.get("n_servers", 1)))
        with self._ns_lock:  # against _fetch_namespace: a namespace learnt there is never dropped here
            if "namespaces" not in reply and n_servers == self.n_servers:
                return
            if "namespaces" in reply:
                self.ns_version, self.namespaces = reply["ns_version"], {**self.namespaces, **reply["namespaces"]}
            self._set_namespaces(n_servers)
            self.n_servers = n_servers  # after: stats report a count only once its shares hold
            self._save_quotas()

    def _set_namespaces(self, n_servers: int) -> None:
        """Each server enforces quota x copies per server / number of servers (see docs/ems.md,
        quotas: a quota counts a tenant's objects once, whatever its replicas); a share that
        shrank (a server joined, a quota was lowered) is enforced at once."""
        def share(v: dict, total: int) -> int:
            return total * min(int(v.get("replicas", 1)), n_servers) // n_servers

        self.shard.set_quotas({name: Quota(share(v, v["dram_bytes"]), share(v, v["ssd_bytes"]))
                               for name, v in self.namespaces.items()})
        self.repair.observe(self.namespaces)  # replicas raised: copy what we hold

    def _save_quotas(self) -> None:
        """The last quotas heard, kept beside the SSD log: a server restarted while the
        controller is away enforces them (not unlimited) until it hears again."""
        tmp = self.quota_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"n_servers": self.n_servers, "namespaces": self.namespaces}, f)
        os.replace(tmp, self.quota_path)

    def _load_quotas(self) -> None:
        try:
            with open(self.quota_path) as f:
                saved = json.load(f)
            self.n_servers, self.namespaces = max(1, int(saved["n_servers"])), dict(saved["namespaces"])
            self._set_namespaces(self.n_servers)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.namespaces = {}  # none yet (or unreadable): learn them from the controller

    def _fetch_namespace(self, ns: str) -> None:
        """Ask the controller about a namespace we have not heard of (at most once a second)."""
        now = time.monotonic()
        if now - self._ns_asked.get(ns, -10.0) < 1.0:
            return
        self._ns_asked[ns] = now
        try:
            reply = call_once(self.cfg.controller, {"op": "ns_list"}, timeout_s=1.0)
        except (OSError, EMSError):
            return
        v = reply["namespaces"].get(ns)
        if v is not None:
            with self._ns_lock:
                self.namespaces = {**self.namespaces, ns: v}
                self._set_namespaces(self.n_servers)

    def heartbeat_loop(self) -> None:
        registered = False
        while not self._stop.is_set():
            try:
                op = {"op": "heartbeat", "id": self.id, "ns_version": self.ns_version}
                if not registered:
                    op = {"op": "register", **self._member()}
                reply = call_once(self.cfg.controller, op, timeout_s=2.0)
                registered = reply.get("known", True)
                self._apply(reply)
                self.repair.notice(reply.get("version"))
            except (OSError, EMSError):
                registered = False  # controller down or restarted: register again when it is back
            self._stop.wait(self.cfg.heartbeat_s)

    def housekeeping_loop(self) -> None:
        while not self._stop.wait(5.0):
            try:
                self.shard.ssd.compact()
            except OSError as e:
                print(f"ems server {self.id}: compaction failed: {e}", file=sys.stderr)

    def serve(self) -> None:
        threading.Thread(target=self.heartbeat_loop, daemon=True).start()
        threading.Thread(target=self.housekeeping_loop, daemon=True).start()
        threading.Thread(target=self.repair.loop, args=(self._stop,), daemon=True).start()
        print(f"READY {self.cfg.host}:{self.rpc.port} id={self.id} recovered={self.shard.ssd.recovered}", flush=True)
        self.rpc.serve_forever()

    def stop(self) -> None:
        """SIGTERM: stop taking connections and requests (clients see misses, as for a dead
        server); `close` then lets the requests in flight finish and flushes."""
        self._stop.set()
        self.rpc.stop()

    def close(self) -> None:
        if self.rpc.closed:
            return  # closed already (signal, then the end of serve)
        self._stop.set()
        self.rpc.close(self.cfg.drain_timeout_s)
        try:
            call_once(self.cfg.controller, {"op": "leave", "id": self.id}, timeout_s=1.0)
        except (OSError, EMSError):
            pass  # controller away: it drops us after the heartbeat timeout
        self.shard.ssd.close()
        self.shm_index.close()
        self.arena.close()


def run_server(cfg: ServerConfig) -> int:
    try:
        server = MPServer(cfg)
    except (OSError, ValueError) as e:
        print(f"ems server: cannot start ({cfg.ssd_dir=}, {cfg.dram_bytes=}): {e}", file=sys.stderr)
        return 2
    return serve_until_signal(server.serve, server.stop, server.close)
