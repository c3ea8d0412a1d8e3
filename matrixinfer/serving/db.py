"""The SQLite file behind tenants, keys and the usage ledger (WAL, one connection per store,
shared by the server's threads under a lock)."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

DEFAULT_DB = Path(os.environ.get("MATRIXINFER_HOME", Path.home() / ".matrixinfer")) / "serving.db"


def connect(path: str | Path) -> sqlite3.Connection:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False, timeout=30, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class SQLiteStore:
    schema = ""  # CREATE TABLE IF NOT EXISTS ... of the subclass

    def __init__(self, path: str | Path = DEFAULT_DB):
        self.path = Path(path)
        self._conn = connect(self.path)
        self._conn.executescript(self.schema)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._conn.close()
