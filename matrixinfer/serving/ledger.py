"""The usage ledger: one SQLite row per finished (or aborted) request, so metering survives
restarts and `matrixinfer usage` can total it per tenant and model and price it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from matrixinfer.serving.db import SQLiteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    request_id TEXT NOT NULL,
    end_user TEXT,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish TEXT
);
CREATE INDEX IF NOT EXISTS usage_tenant_ts ON usage(tenant, ts);
"""


@dataclass(frozen=True)
class Prices:
    """USD per million tokens. Cached input (a prefix-cache hit) is priced separately."""

    input: float = 0.27
    cached_input: float = 0.07
    output: float = 1.10


@dataclass
class UsageTotals:
    tenant: str
    model: str
    requests: int
    input_tokens: int  # all prompt tokens, cached ones included
    cached_input_tokens: int
    output_tokens: int

    def cost(self, prices: Prices) -> float:
        uncached = self.input_tokens - self.cached_input_tokens
        return (uncached * prices.input + self.cached_input_tokens * prices.cached_input
                + self.output_tokens * prices.output) / 1e6


class UsageLedger(SQLiteStore):
    schema = _SCHEMA

    def record(self, tenant: str, model: str, request_id: str, prompt_tokens: int, cached_tokens: int,
               completion_tokens: int, end_user: str | None = None, finish: str | None = None,
               ts: float | None = None) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT INTO usage(ts, tenant, model, request_id, end_user, prompt_tokens, cached_tokens, "
                "completion_tokens, finish) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (time.time() if ts is None else ts, tenant, model, request_id, end_user, prompt_tokens,
                 cached_tokens, completion_tokens, finish))

    def totals(self, tenant: str | None = None, since: float | None = None) -> list[UsageTotals]:
        """Totals per (tenant, model), optionally for one tenant and from a time (epoch s) on."""
        where, args = [], []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        sql = ("SELECT tenant, model, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens) "
               "FROM usage" + (" WHERE " + " AND ".join(where) if where else "") + " GROUP BY tenant, model "
               "ORDER BY tenant, model")
        with self._lock:
            rows = self._conn.execute(sql, args).fetchall()
        return [UsageTotals(*row) for row in rows]

    def tenant_tokens_since(self, tenant: str, since: float) -> tuple[int, int]:
        """(prompt tokens, completion tokens) metered for `tenant` from `since` on."""
        with self._lock:
            row = self._conn.execute("SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
                                     "FROM usage WHERE tenant = ? AND ts >= ?", (tenant, since)).fetchone()
        return int(row[0]), int(row[1])
