"""The EMS controller: metadata only (membership, hash-ring view, namespaces and quotas).

MP servers register and heartbeat; a server silent for `heartbeat_timeout_s` is dropped and
the view version bumps. Clients pull the view (servers + vnodes) and build the same ring
locally, so data never passes through here.
"""

from __future__ import annotations

import threading
import time

from .config import ControllerConfig
from .protocol import EMSError, RPCServer, drain, serve_until_signal

NS_LIMIT = 1 << 62


class Controller:
    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.members: dict[str, dict] = {}
        self.last_seen: dict[str, float] = {}
        self.version = 0
        self.namespaces: dict[str, dict] = {"default": {"dram_bytes": NS_LIMIT, "ssd_bytes": NS_LIMIT}}
        self.ns_version = 0
        self.rpc = RPCServer(cfg.host, cfg.port, self.handle)
        self._stop = threading.Event()

    def handle(self, h: dict, plen: int, sock):
        if plen:
            drain(sock, plen)
        fn = getattr(self, f"op_{h.get('op')}", None)
        if fn is None:
            raise EMSError(f"unknown op {h.get('op')!r}")
        with self.lock:
            return fn(h), []

    def _ns_reply(self, known_version: int) -> dict:
        out = {"n_servers": len(self.members), "ns_version": self.ns_version}
        if known_version != self.ns_version:
            out["namespaces"] = self.namespaces
        return out

    def op_register(self, h):
        sid = h.get("id")
        if not isinstance(sid, str) or not isinstance(h.get("port"), int):
            raise EMSError("register needs id and port")
        member = {k: h.get(k) for k in ("id", "host", "port", "shm", "idx", "boot_id")}
        if self.members.get(sid) != member:
            self.members[sid] = member
            self.version += 1
        self.last_seen[sid] = time.monotonic()
        return {"ok": True, "known": True, "version": self.version, **self._ns_reply(-1)}

    def op_heartbeat(self, h):
        sid = h.get("id")
        if sid not in self.members:
            return {"ok": True, "known": False}
        self.last_seen[sid] = time.monotonic()
        return {"ok": True, "known": True, **self._ns_reply(h.get("ns_version", -1))}

    def op_view(self, h):
        return {"ok": True, "version": self.version, "vnodes": self.cfg.vnodes, "servers": sorted(self.members.values(), key=lambda m: m["id"])}

    def op_ns_create(self, h):
        name = h.get("name")
        if not isinstance(name, str) or not name or len(name) > 255:
            raise EMSError("namespace name must be a non-empty string of at most 255 characters")
        quota = {}
        for k in ("dram_bytes", "ssd_bytes"):
            v = h.get(k)
            v = NS_LIMIT if v is None else v
            if not isinstance(v, int) or v <= 0:
                raise EMSError(f"{k} must be a positive integer")
            quota[k] = v
        if h.get("if_absent") and name in self.namespaces:
            return {"ok": True, "created": False, "ns_version": self.ns_version}
        self.namespaces[name] = quota
        self.ns_version += 1
        return {"ok": True, "created": True, "ns_version": self.ns_version}

    def op_ns_list(self, h):
        return {"ok": True, "ns_version": self.ns_version, "namespaces": self.namespaces}

    def reap_loop(self) -> None:
        """Drop servers that stopped heartbeating: their keys become misses, then remap."""
        while not self._stop.wait(self.cfg.heartbeat_timeout_s / 4):
            now = time.monotonic()
            with self.lock:
                dead = [s for s, t in self.last_seen.items() if now - t > self.cfg.heartbeat_timeout_s]
                for s in dead:
                    self.members.pop(s, None)
                    self.last_seen.pop(s, None)
                if dead:
                    self.version += 1

    def serve(self) -> None:
        threading.Thread(target=self.reap_loop, daemon=True).start()
        print(f"READY {self.cfg.host}:{self.rpc.port}", flush=True)
        self.rpc.serve_forever()

    def close(self) -> None:
        self._stop.set()
        self.rpc.close()


def run_controller(cfg: ControllerConfig) -> int:
    ctl = Controller(cfg)
    return serve_until_signal(ctl.serve, ctl.close)
