"""Per-tenant admission: token quotas per calendar period and rate limits per minute.

Quotas: admission *reserves* the request's prompt tokens and the most it may generate
(max_tokens x choices) on top of what the ledger has metered this period and what requests
in flight hold reserved; a request that does not fit is refused. When it ends the
reservation is settled to its real usage. So however many requests run at once, a tenant
never exceeds its quota (it may be refused while reservations are larger than the usage
they settle to). Rate limits use a sliding 60 s window of admissions (requests/min) and of
tokens (prompt tokens at admission, completion tokens at finish).
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import datetime, timezone

from matrixinfer.serving.ledger import UsageLedger
from matrixinfer.serving.tenants import Tenant

WINDOW_S = 60.0


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after: float, code: str):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))
        self.code = code


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """Start and end (epoch seconds) of the calendar period (UTC) that contains `now`."""
    t = datetime.fromtimestamp(now, timezone.utc)
    if period == "hour":
        start = t.replace(minute=0, second=0, microsecond=0)
        end = start.timestamp() + 3600
    elif period == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start.timestamp() + 86400
    elif period == "month":
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        nxt = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        end = nxt.timestamp()
    else:
        raise ValueError(f"unknown period {period!r}")
    return start.timestamp(), end


@dataclass
class Reservation:
    """Tokens held for one admitted request until it finishes."""

    prompt_tokens: int
    completion_tokens: int


class Limiter:
    def __init__(self, ledger: UsageLedger | None, clock=time.time):
        self.ledger = ledger
        self.clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, deque[float]] = defaultdict(deque)
        self._tokens: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._period_used: dict[tuple[str, float], list[int]] = {}  # (tenant, period start) -> [in, out]
        self._reserved: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # tenant -> [in, out] in flight

    def admit(self, tenant: Tenant, prompt_tokens: int, max_completion_tokens: int = 0) -> Reservation:
        """Count the request in and reserve its tokens, or raise LimitExceeded (nothing counted)."""
        now = self.clock()
        with self._lock:
            self._check_quota(tenant, prompt_tokens, max_completion_tokens, now)
            reqs, toks = self._window(tenant.name, now)
            if tenant.requests_per_min is not None and len(reqs) >= tenant.requests_per_min:
                raise LimitExceeded(f"rate limit reached for {tenant.name!r}: {tenant.requests_per_min} requests/min",
                                    reqs[0] + WINDOW_S - now, "rate_limit_exceeded")
            if tenant.tokens_per_min is not None:
                used = sum(n for _, n in toks)
                if used + prompt_tokens > tenant.tokens_per_min:
                    retry = self._tokens_free_at(toks, used + prompt_tokens - tenant.tokens_per_min) - now
                    raise LimitExceeded(f"rate limit reached for {tenant.name!r}: {tenant.tokens_per_min} tokens/min "
                                        f"(used {used}, this request's prompt {prompt_tokens})",
                                        retry, "rate_limit_exceeded")
            reqs.append(now)
            toks.append((now, prompt_tokens))
            reserved = self._reserved[tenant.name]
            reserved[0] += prompt_tokens
            reserved[1] += max_completion_tokens
            return Reservation(prompt_tokens, max_completion_tokens)

    def finish(self, tenant: Tenant, prompt_tokens: int, completion_tokens: int,
               reservation: Reservation | None = None) -> None:
        """Settle a finished request: its reservation is released, its real tokens counted
        (after the ledger has recorded them)."""
        now = self.clock()
        with self._lock:
            if reservation is not None:
                reserved = self._reserved[tenant.name]
                reserved[0] -= reservation.prompt_tokens
                reserved[1] -= reservation.completion_tokens
            self._tokens[tenant.name].append((now, completion_tokens))
            used = self._used(tenant, now, refresh=False)
            if used is not None:
                used[0] += prompt_tokens
                used[1] += completion_tokens

    def _window(self, name: str, now: float):
        reqs, toks = self._requests[name], self._tokens[name]
        while reqs and reqs[0] <= now - WINDOW_S:
            reqs.popleft()
        while toks and toks[0][0] <= now - WINDOW_S:
            toks.popleft()
        return reqs, toks

    @staticmethod
    def _tokens_free_at(toks, excess: int) -> float:
        freed = 0
        for t, n in toks:
            freed += n
            if freed >= excess:
                return t + WINDOW_S
        return (toks[-1][0] if toks else 0) + WINDOW_S

    def _used(self, tenant: Tenant, now: float, refresh: bool = True) -> list[int] | None:
        start, _ = period_bounds(tenant.period, now)
        key = (tenant.name, start)
        if key not in self._period_used:
            if not refresh:
                return None
            self._period_used = {k: v for k, v in self._period_used.items() if k[0] != tenant.name}
            used = self.ledger.tenant_tokens_since(tenant.name, start) if self.ledger else (0, 0)
            self._period_used[key] = list(used)
        return self._period_used[key]

    def _check_quota(self, tenant: Tenant, prompt_tokens: int, max_completion_tokens: int, now: float) -> None:
        if tenant.input_tokens_per_period is None and tenant.output_tokens_per_period is None:
            return
        used_in, used_out = self._used(tenant, now)
        held_in, held_out = self._reserved[tenant.name]
        _, end = period_bounds(tenant.period, now)
        quota_in, quota_out = tenant.input_tokens_per_period, tenant.output_tokens_per_period

        def retry(used: int, want: int, quota: int) -> float:
            # fits once the requests in flight settle (to at most what they hold): soon
            return 1.0 if used + want <= quota else end - now

        if quota_in is not None and used_in + held_in + prompt_tokens > quota_in:
            raise LimitExceeded(f"input token quota of {tenant.name!r} exhausted: {used_in} of {quota_in} used this "
                                f"{tenant.period} and {held_in} held by requests in flight; this prompt has "
                                f"{prompt_tokens}", retry(used_in, prompt_tokens, quota_in), "insufficient_quota")
        if quota_out is not None and used_out + held_out + max_completion_tokens > quota_out:
            raise LimitExceeded(f"output token quota of {tenant.name!r} exhausted: {used_out} of {quota_out} used this "
                                f"{tenant.period} and {held_out} held by requests in flight; this request may "
                                f"generate {max_completion_tokens} (max_tokens x choices): lower max_tokens",
                                retry(used_out, max_completion_tokens, quota_out), "insufficient_quota")
