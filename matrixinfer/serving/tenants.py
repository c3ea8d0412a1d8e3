"""Tenants and their API keys, in SQLite. A key is shown once, when it is made; the store
keeps only its SHA-256 (keys are 256 random bits, so a fast hash is enough) and a short
prefix to recognise it by. Each tenant carries its quotas and rate limits (None: unlimited).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, fields

from matrixinfer.serving.db import SQLiteStore

KEY_PREFIX = "mi-"
PERIODS = ("hour", "day", "month")
ANONYMOUS = "anonymous"  # the tenant of every request when no keys are configured

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    input_tokens_per_period INTEGER,
    output_tokens_per_period INTEGER,
    period TEXT NOT NULL DEFAULT 'day',
    requests_per_min INTEGER,
    tokens_per_min INTEGER
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_hash TEXT PRIMARY KEY,
    prefix TEXT NOT NULL,
    tenant TEXT NOT NULL REFERENCES tenants(name),
    created REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0
);
"""


@dataclass(frozen=True)
class Tenant:
    name: str
    input_tokens_per_period: int | None = None  # quota of prompt tokens per period
    output_tokens_per_period: int | None = None  # quota of completion tokens per period
    period: str = "day"  # hour | day | month, calendar periods in UTC
    requests_per_min: int | None = None
    tokens_per_min: int | None = None  # prompt + completion tokens in any 60 s window


LIMIT_FIELDS = [f.name for f in fields(Tenant) if f.name != "name"]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantStore(SQLiteStore):
    schema = _SCHEMA

    def set_tenant(self, name: str, **limits) -> Tenant:
        """Create the tenant or update the limits given (others keep their values)."""
        if not name:
            raise ValueError("tenant name must be non-empty")
        unknown = set(limits) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"unknown tenant limits: {sorted(unknown)}")
        if limits.get("period", "day") not in PERIODS:
            raise ValueError(f"period must be one of {PERIODS}")
        with self._lock:
            self._conn.execute("INSERT OR IGNORE INTO tenants(name) VALUES (?)", (name,))
            for key, value in limits.items():
                self._conn.execute(f"UPDATE tenants SET {key} = ? WHERE name = ?", (value, name))
        return self.tenant(name)

    def tenant(self, name: str) -> Tenant | None:
        with self._lock:
            row = self._conn.execute(f"SELECT name, {', '.join(LIMIT_FIELDS)} FROM tenants WHERE name = ?",
                                     (name,)).fetchone()
        return Tenant(*row) if row else None

    def add_key(self, tenant: str, key: str | None = None, **limits) -> str:
        """A new API key for `tenant` (created if new, its limits updated with `limits`).
        `key` imports an existing key instead of making a random one."""
        self.set_tenant(tenant, **limits)
        key = key or KEY_PREFIX + secrets.token_urlsafe(32)
        with self._lock:
            self._conn.execute("INSERT INTO api_keys(key_hash, prefix, tenant, created) VALUES (?, ?, ?, ?)",
                               (hash_key(key), key[:10], tenant, time.time()))
        return key

    def revoke(self, prefix: str) -> int:
        with self._lock:
            cur = self._conn.execute("UPDATE api_keys SET revoked = 1 WHERE prefix = ? AND revoked = 0", (prefix,))
        return cur.rowcount

    def list_keys(self) -> list[tuple[str, str, float, bool]]:
        """(prefix, tenant, created, revoked) of every key."""
        with self._lock:
            rows = self._conn.execute("SELECT prefix, tenant, created, revoked FROM api_keys ORDER BY created").fetchall()
        return [(p, t, c, bool(r)) for p, t, c, r in rows]

    def has_keys(self) -> bool:
        """Whether any key was ever made: revoking every key locks the server, it does not open it."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM api_keys LIMIT 1").fetchone() is not None

    def authenticate(self, key: str) -> Tenant | None:
        with self._lock:
            row = self._conn.execute(
                f"SELECT t.name, {', '.join('t.' + f for f in LIMIT_FIELDS)} FROM api_keys k "
                "JOIN tenants t ON t.name = k.tenant WHERE k.key_hash = ? AND k.revoked = 0",
                (hash_key(key),)).fetchone()
        return Tenant(*row) if row else None
