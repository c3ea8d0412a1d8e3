"""The controller's durable state in SQLite: namespaces and their quotas, the members of the
ring and the view versions. Written on every change (they are rare: registrations, leaves,
namespace creations), read once at start, so a restarted controller (even after kill -9)
serves the same namespaces, quotas and ring, and never reuses a view version.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

_SCHEMA = """
CREATE TABLE IF NOT EXISTS namespaces (name TEXT PRIMARY KEY, quota TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (id TEXT PRIMARY KEY, member TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class ControllerState:
    """`path=None`: nothing persisted (an in-memory database), as before this store existed."""

    def __init__(self, path: str | None):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._conn = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")  # a quota acknowledged is a quota kept
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def load(self) -> tuple[dict[str, dict], dict[str, dict], int, int]:
        """(namespaces, members, ring version, namespace version) as last saved."""
        with self._lock:
            ns = {n: json.loads(q) for n, q in self._conn.execute("SELECT name, quota FROM namespaces")}
            members = {i: json.loads(m) for i, m in self._conn.execute("SELECT id, member FROM members")}
            meta = dict(self._conn.execute("SELECT key, value FROM meta"))
        return ns, members, meta.get("version", 0), meta.get("ns_version", 0)

    def save_namespace(self, name: str, quota: dict, ns_version: int) -> None:
        with self._lock, self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("INSERT OR REPLACE INTO namespaces VALUES (?, ?)", (name, json.dumps(quota)))
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('ns_version', ?)", (ns_version,))

    def save_members(self, members: dict[str, dict], version: int) -> None:
        with self._lock, self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("DELETE FROM members")
            self._conn.executemany("INSERT INTO members VALUES (?, ?)", [(i, json.dumps(m)) for i, m in members.items()])
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (version,))

    def close(self) -> None:
        with self._lock:
            self._conn.close()
