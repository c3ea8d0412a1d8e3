"""The EMS controller: metadata only (membership, hash-ring view, namespaces and quotas).

MP servers register and heartbeat; a server silent for `heartbeat_timeout_s` is dropped and
the view version bumps. Clients pull the view (servers + vnodes) and build the same ring
locally, so data never passes through here. A namespace's `replicas` (N copies of each
object, on the owner and the next N-1 distinct servers of the ring) is metadata like its
quotas; the copies themselves are the clients' and servers' business. Namespaces, quotas,
replicas, members and versions are kept in SQLite (`state.py`) and restored on start.
"""

from __future__ import annotations

import threading
import time

from .config import ControllerConfig
from .arena import reap_dead_arenas
from .protocol import EMSError, RPCServer, drain, serve_until_signal
from .state import ControllerState

NS_LIMIT = 1 << 62
MAX_REPLICAS = 16


def replicas_of(ns: dict) -> int:
    """Namespaces saved before replicas existed have one copy."""
    return int(ns.get("replicas", 1))


class Controller:
    def __init__(self, cfg: ControllerConfig):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.state = ControllerState(cfg.db)
        namespaces, self.members, version, self.ns_version = self.state.load()
        self.namespaces = {"default": {"dram_bytes": NS_LIMIT, "ssd_bytes": NS_LIMIT, "explicit": False}, **namespaces}
        # Restored members count as alive until they miss the heartbeat timeout, so the ring
        # does not empty while they notice the restart; the bump means no view number is
        # ever served twice with different contents.
        self.last_seen = dict.fromkeys(self.members, time.monotonic())
        self.version = version + 1
        self.state.save_members(self.members, self.version)
        reap_dead_arenas(cfg.shm_dir)
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
            self.state.save_members(self.members, self.version)
        self.last_seen[sid] = time.monotonic()
        return {"ok": True, "known": True, "version": self.version, **self._ns_reply(-1)}

    def op_leave(self, h):
        """A server shutting down cleanly: drop it now rather than after the heartbeat timeout."""
        if self.members.pop(h.get("id"), None) is not None:
            self.last_seen.pop(h.get("id"), None)
            self.version += 1
            self.state.save_members(self.members, self.version)
        return {"ok": True}

    def op_heartbeat(self, h):
        sid = h.get("id")
        if sid not in self.members:
            return {"ok": True, "known": False}
        self.last_seen[sid] = time.monotonic()
        # the view version tells the server when to re-replicate (repair.py)
        return {"ok": True, "known": True, "version": self.version, **self._ns_reply(h.get("ns_version", -1))}

    def op_view(self, h):
        """The ring; with `ns`, also that namespace's replica count (a client reads it at
        every refresh, so a redefinition reaches running clients)."""
        ns = self.namespaces.get(h.get("ns")) or {}
        return {"ok": True, "version": self.version, "vnodes": self.cfg.vnodes, "replicas": replicas_of(ns),
                "servers": sorted(self.members.values(), key=lambda m: m["id"])}

    def op_ns_create(self, h):
        """Create or redefine a namespace. Without quotas or replicas (a client's implicit
        creation on first use) it is created unlimited, one copy, and *implicit*; a later
        creation that gives any of them applies them even with `if_absent`, so the order of
        the two does not matter."""
        name = h.get("name")
        if not isinstance(name, str) or not name or len(name) > 255:
            raise EMSError("namespace name must be a non-empty string of at most 255 characters")
        given = [k for k in ("dram_bytes", "ssd_bytes", "replicas") if h.get(k) is not None]
        quota = {"explicit": bool(given)}
        for k, default in (("dram_bytes", NS_LIMIT), ("ssd_bytes", NS_LIMIT), ("replicas", 1)):
            v = h.get(k)
            v = default if v is None else v
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise EMSError(f"{k} must be a positive integer")
            quota[k] = v
        if quota["replicas"] > MAX_REPLICAS:
            raise EMSError(f"replicas must be at most {MAX_REPLICAS}")
        cur = self.namespaces.get(name)
        if h.get("if_absent") and cur is not None and (cur.get("explicit", True) or not quota["explicit"]):
            return {"ok": True, "created": False, "ns_version": self.ns_version, "replicas": replicas_of(cur)}
        self.namespaces[name] = quota
        self.ns_version += 1
        self.state.save_namespace(name, quota, self.ns_version)
        return {"ok": True, "created": True, "ns_version": self.ns_version, "replicas": quota["replicas"]}

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
                    self.state.save_members(self.members, self.version)

    def serve(self) -> None:
        threading.Thread(target=self.reap_loop, daemon=True).start()
        print(f"READY {self.cfg.host}:{self.rpc.port}", flush=True)
        self.rpc.serve_forever()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.rpc.close()
        with self.lock:
            self.state.close()


def run_controller(cfg: ControllerConfig) -> int:
    ctl = Controller(cfg)
    return serve_until_signal(ctl.serve, ctl.rpc.stop, ctl.close)
