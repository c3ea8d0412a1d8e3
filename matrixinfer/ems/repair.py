"""Background re-replication: an MP server restores N copies of what it holds after the ring
changed (a holder died, joined or came back).

When the view version (or a namespace) changes, the server walks the keys it holds in every
namespace with `replicas` > 1, computes their holders in the new view, asks the other holders
which keys they have (`exists`) and sends the missing copies straight to them (`put_many`: the
ordinary two-phase put, so a copy is readable there only once whole and durable). One server
sends each key: its first holder in ring order that has it (a server that is no longer a
holder sends only when no holder has it). Data flows server to server; the controller keeps
metadata only. A pass that could not send everything is retried.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .protocol import Connection, EMSError, call_once
from .shard import Shard
from .view import ClusterView, by_server

NET_ERRORS = (OSError, ConnectionError, TimeoutError)
MAX_KEYS = 4096  # server.MAX_BATCH: keys per request
MAX_SEND_BYTES = 16 << 20  # values per put_many
RETRY_S = 1.0


@dataclass
class RepairStats:
    """Reported in the server's stats (`repair`) and in one log line per pass that sent."""
    passes: int = 0
    objects: int = 0  # copies sent, all passes
    bytes: int = 0
    seconds: float = 0.0
    failed: int = 0  # copies that could not be sent (target gone, refused): retried
    version: int = -1  # view version of the last pass that left nothing to send
    last_objects: int = 0
    last_bytes: int = 0
    last_seconds: float = 0.0


class Repairer:
    def __init__(self, server_id: str, shard: Shard, controller: str, namespaces: Callable[[], dict],
                 timeout_s: float = 5.0):
        self.id, self.shard, self.controller, self.namespaces = server_id, shard, controller, namespaces
        self.timeout_s = timeout_s
        self.stats = RepairStats()
        self._wake = threading.Event()
        self._version = -1  # view version last heard
        self._replicas: dict[str, int] = {}  # namespace -> replicas, last heard
        self._due = self._done = 0  # passes asked for / the last one completed

    def notice(self, version: int | None) -> None:
        """The view version a heartbeat heard: a pass is due when the ring changed."""
        if version is not None and version != self._version:
            self._version = version
            self._ask()

    def observe(self, namespaces: dict) -> None:
        """The server's namespaces changed: a pass is due if one's replicas grew. Not for a
        namespace new to this server (it learns one at its first request, so nothing of it was
        stored with fewer copies) nor a quota: a pass racing first puts would send copies
        already in flight."""
        replicas = {ns: int(v.get("replicas", 1)) for ns, v in namespaces.items()}
        grew = any(r > self._replicas.get(ns, r) for ns, r in replicas.items())
        self._replicas = replicas
        if grew:
            self._ask()

    def _ask(self) -> None:
        self._due += 1
        self._wake.set()

    def loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.wait(RETRY_S)
            self._wake.clear()
            due = self._due
            if stop.is_set() or due == self._done:
                continue
            try:
                if self.run_pass():
                    self._done = due
            except (*NET_ERRORS, EMSError) as e:  # controller away: try again
                print(f"ems server {self.id}: re-replication deferred: {e}", file=sys.stderr, flush=True)

    def run_pass(self) -> bool:
        """One walk over every replicated namespace; True if nothing was left unsent."""
        t0 = time.monotonic()
        view = ClusterView.from_reply(call_once(self.controller, {"op": "view"}, self.timeout_s))
        if self.id not in view.members:
            return False  # not (yet, or no longer) in the ring: our copies are not the ring's
        conns: dict[str, Connection] = {}
        sent = nbytes = failed = 0
        try:
            for ns, spec in list(self.namespaces().items()):
                replicas = int(spec.get("replicas", 1))
                if replicas < 2:
                    continue
                for target, keys in self._missing(view, ns, replicas, conns).items():
                    s, b, f = self._send(conns[target], ns, keys)
                    sent, nbytes, failed = sent + s, nbytes + b, failed + f
        finally:
            for c in conns.values():
                c.close()
        secs = time.monotonic() - t0
        st = self.stats
        st.passes, st.objects, st.bytes, st.seconds, st.failed = (st.passes + 1, st.objects + sent, st.bytes + nbytes,
                                                                  st.seconds + secs, st.failed + failed)
        st.last_objects, st.last_bytes, st.last_seconds = sent, nbytes, secs
        if not failed:
            st.version = view.version
        if sent or failed:
            print(f"ems server {self.id}: re-replicated {sent} objects ({nbytes} bytes) in {secs:.3f} s for view "
                  f"{view.version}" + (f", {failed} not sent (retrying)" if failed else ""), file=sys.stderr, flush=True)
        return failed == 0

    def _conn(self, view: ClusterView, sid: str, conns: dict[str, Connection]) -> Connection:
        if sid not in conns:
            m = view.members[sid]
            conns[sid] = Connection((m.host, m.port), self.timeout_s)
        return conns[sid]

    def _missing(self, view: ClusterView, ns: str, replicas: int, conns) -> dict[str, list[str]]:
        """The keys this server should send, by target: holders that lack them."""
        keys = self.shard.ssd.keys(ns)
        placements = [view.owners(ns, k, replicas) for k in keys]
        has: set[tuple[str, int]] = set()  # (holder, key index) known to hold it
        others = by_server([[s for s in p if s != self.id] for p in placements])
        for sid, idx in others.items():
            conn = self._conn(view, sid, conns)
            for i in range(0, len(idx), MAX_KEYS):
                batch = idx[i : i + MAX_KEYS]
                try:
                    found = conn.call({"op": "exists", "ns": ns, "keys": [keys[j] for j in batch]})[0]["found"]
                except (*NET_ERRORS, EMSError):
                    found = [False] * len(batch)  # unknown: sending to it will fail and be retried
                has.update((sid, j) for j, f in zip(batch, found) if f)
        plan: dict[str, list[str]] = {}
        for j, holders in enumerate(placements):
            ahead = holders[: holders.index(self.id)] if self.id in holders else holders
            if any((s, j) in has for s in ahead):
                continue  # a holder before us in ring order has it and sends it
            for s in holders:
                if s != self.id and (s, j) not in has:
                    plan.setdefault(s, []).append(keys[j])
        return plan

    def _send(self, conn: Connection, ns: str, keys: list[str]) -> tuple[int, int, int]:
        """(objects stored there, their bytes, objects not stored) for keys sent to one holder."""
        sent = nbytes = failed = 0
        batch: list[tuple[str, bytes]] = []

        def flush() -> None:
            nonlocal sent, nbytes, failed
            if not batch:
                return
            try:
                stored = conn.call({"op": "put_many", "ns": ns, "keys": [k for k, _ in batch],
                                    "lens": [len(v) for _, v in batch]}, [v for _, v in batch])[0]["stored"]
            except (*NET_ERRORS, EMSError):
                stored = [False] * len(batch)
            for (_, v), ok in zip(batch, stored):
                sent, nbytes, failed = sent + ok, nbytes + len(v) * ok, failed + (not ok)
            batch.clear()

        size = 0
        for k in keys:
            v = self.shard.peek(ns, k)
            if v is None:
                continue  # deleted or evicted from SSD meanwhile: nothing to restore
            if batch and (len(batch) >= MAX_KEYS or size + len(v) > MAX_SEND_BYTES):
                flush()
                size = 0
            batch.append((k, v))
            size += len(v)
        flush()
        return sent, nbytes, failed
