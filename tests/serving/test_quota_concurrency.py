"""Quotas hold under concurrency: admission reserves prompt + max_tokens x choices and the
end of a request settles the reservation to its real usage."""

import asyncio

import httpx

from matrixinfer.serving import Tenant
from matrixinfer.serving.limits import LimitExceeded, Limiter
from tests.serving.conftest import start_service


def test_32_concurrent_requests_never_exceed_a_small_quota(engine, tmp_path):
    """32 requests of 5 output tokens at once against a 50-token output quota (and a 200-token
    input quota, 10 per prompt): exactly 10 are served, the others get 429 insufficient_quota,
    and the ledger holds exactly the quota, never more."""
    server, tenants, ledger = start_service(engine, tmp_path / "serving.db")
    try:
        key = tenants.add_key("small", output_tokens_per_period=50, input_tokens_per_period=200)

        async def run():
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
                body = {"prompt": list(range(40, 50)), "max_tokens": 5, "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(*[client.post(server.url + "/v1/completions", json=body)
                                              for _ in range(32)])

        codes = sorted(r.status_code for r in asyncio.run(run()))
        assert codes == [200] * 10 + [429] * 22
        (t,) = ledger.totals("small")
        assert (t.requests, t.output_tokens, t.input_tokens) == (10, 50, 100)
    finally:
        server.stop()
        tenants.close()
        ledger.close()


def test_reservations_settle_to_real_usage():
    """A request that stops early gives back what it reserved but did not use; while one is in
    flight its whole reservation counts, and a refusal it causes says to retry soon."""
    limiter = Limiter(None, clock=lambda: 1000.0)
    tenant = Tenant("t", output_tokens_per_period=10)
    held = limiter.admit(tenant, 3, 8)
    try:
        limiter.admit(tenant, 3, 8)
        raise AssertionError("admitted over the quota")
    except LimitExceeded as e:
        assert e.code == "insufficient_quota" and e.retry_after == 1 and "in flight" in str(e)
    limiter.finish(tenant, 3, 2, held)  # stopped after 2 tokens
    limiter.admit(tenant, 3, 8)  # 2 used + 8 reserved = 10: fits
