"""Tenants: API keys (401 without a good one once keys exist), quotas and rate limits (429 with
Retry-After), the SQLite ledger across restarts, `matrixinfer usage` pricing, and one prefix
cache namespace per tenant."""

import httpx
import pytest

from matrixinfer.cli import main as cli_main
from matrixinfer.serving import Prices, Tenant, UsageLedger
from matrixinfer.serving.ledger import UsageTotals
from matrixinfer.serving.limits import LimitExceeded, Limiter
from tests.serving.conftest import start_service

PROMPT_10 = list(range(40, 50))  # ten token ids


@pytest.fixture
def fresh(engine, tmp_path):
    """A server with its own, empty key and ledger database."""
    server, tenants, ledger = start_service(engine, tmp_path / "serving.db")
    yield server, tenants, ledger, tmp_path / "serving.db"
    server.stop()
    tenants.close()
    ledger.close()


def _complete(server, key=None, prompt=PROMPT_10, max_tokens=5):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                      json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})


def test_keys_turn_authentication_on(fresh):
    """Without keys anyone is served (as 'anonymous'); once a key exists, no key or a wrong or
    revoked key is a 401 and the right key is served as its tenant."""
    server, tenants, ledger, _ = fresh
    assert _complete(server).status_code == 200
    key = tenants.add_key("acme")
    r = _complete(server)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = _complete(server, key="mi-not-a-key")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert _complete(server, key).status_code == 200
    assert [t.tenant for t in ledger.totals()] == ["acme", "anonymous"]
    tenants.revoke(key[:10])
    assert _complete(server, key).status_code == 401


def test_keys_are_stored_hashed(fresh):
    """The database never holds a key in the clear."""
    _, tenants, _, path = fresh
    key = tenants.add_key("acme")
    assert key.encode() not in path.read_bytes()


def test_requests_per_minute_limit(fresh):
    """A tenant over its requests/min gets 429 with a Retry-After of at most a minute; other
    tenants are not affected."""
    server, tenants, _, _ = fresh
    slow, other = tenants.add_key("slow", requests_per_min=2), tenants.add_key("other")
    assert [_complete(server, slow).status_code for _ in range(2)] == [200, 200]
    r = _complete(server, slow)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert _complete(server, other).status_code == 200


def test_tokens_per_minute_limit(fresh):
    """Prompt tokens count at admission and completion tokens at finish against tokens/min."""
    server, tenants, _, _ = fresh
    key = tenants.add_key("t", tokens_per_min=30)
    assert _complete(server, key).status_code == 200  # 10 + 5
    assert _complete(server, key).status_code == 200  # 15 + 10 <= 30, then 30 used
    r = _complete(server, key)
    assert r.status_code == 429 and "tokens/min" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 60


def test_token_quotas_hold_across_restarts(fresh, engine):
    """Input and output token quotas per period give 429 insufficient_quota with a Retry-After
    up to the period's end, and still hold for a new server on the same ledger."""
    server, tenants, _, path = fresh
    key_in = tenants.add_key("small-in", input_tokens_per_period=25)
    key_out = tenants.add_key("small-out", output_tokens_per_period=5, period="hour")
    assert [_complete(server, key_in).status_code for _ in range(3)] == [200, 200, 429]
    assert [_complete(server, key_out).status_code for _ in range(2)] == [200, 429]
    r = _complete(server, key_out)
    assert r.json()["error"]["code"] == "insufficient_quota" and 1 <= int(r.headers["Retry-After"]) <= 3600
    server.stop()
    again, t2, l2 = start_service(engine, path)
    try:
        assert _complete(again, key_in).status_code == 429
        assert _complete(again, key_out).status_code == 429
    finally:
        again.stop()
        t2.close()
        l2.close()


def test_rate_window_slides():
    """The per-minute window forgets admissions older than 60 s (fake clock)."""
    now = [1000.0]
    limiter = Limiter(None, clock=lambda: now[0])
    tenant = Tenant("x", requests_per_min=1)
    limiter.admit(tenant, 3)
    now[0] += 20
    with pytest.raises(LimitExceeded) as e:
        limiter.admit(tenant, 3)
    assert e.value.retry_after == 40
    now[0] += 41
    limiter.admit(tenant, 3)


def test_ledger_survives_restart_and_usage_prices_it(fresh, capsys):
    """Metered requests are in the SQLite ledger after the server is gone; `matrixinfer usage`
    totals them per tenant with cost, cached input priced separately; --since filters."""
    server, tenants, ledger, path = fresh
    key = tenants.add_key("acme")
    for _ in range(3):
        assert _complete(server, key).status_code == 200
    server.stop()
    ledger.close()
    totals = UsageLedger(path).totals("acme")
    assert len(totals) == 1
    t = totals[0]
    assert (t.requests, t.input_tokens, t.output_tokens) == (3, 30, 15)
    assert cli_main(["usage", "--keys-db", str(path), "--tenant", "acme", "--json", "--price-input", "1",
                     "--price-cached-input", "0.5", "--price-output", "2"]) == 0
    row = __import__("json").loads(capsys.readouterr().out)[0]
    assert row["output_tokens"] == 15
    expected = ((30 - t.cached_input_tokens) * 1 + t.cached_input_tokens * 0.5 + 15 * 2) / 1e6
    assert row["cost_usd"] == pytest.approx(expected)
    assert cli_main(["usage", "--keys-db", str(path), "--since", "2999-01-01"]) == 0
    assert "acme" not in capsys.readouterr().out


def test_cached_input_is_priced_separately():
    """Cost = uncached input x input price + cached input x cached price + output x output price."""
    t = UsageTotals("a", "m", requests=2, input_tokens=1_000_000, cached_input_tokens=400_000, output_tokens=500_000)
    assert t.cost(Prices(input=1.0, cached_input=0.25, output=4.0)) == pytest.approx(0.6 + 0.1 + 2.0)


def test_tenants_never_share_cached_prefixes(fresh):
    """A prompt cached for tenant A is a cache hit for A again but never for tenant B; B's own
    repeat hits its own cache."""
    server, tenants, _, _ = fresh
    a, b = tenants.add_key("a"), tenants.add_key("b")
    prompt = list(range(60, 100))  # 40 tokens = 10 full blocks of 4

    def cached(key):
        r = _complete(server, key, prompt=prompt, max_tokens=2)
        assert r.status_code == 200
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(a) == 0
    assert cached(a) >= 36
    assert cached(b) == 0
    assert cached(b) >= 36


def test_keys_cli_prints_a_working_key(fresh, capsys):
    """`matrixinfer keys add --tenant NAME` prints one key that the running server accepts."""
    server, _, _, path = fresh
    assert cli_main(["keys", "add", "--tenant", "cli", "--keys-db", str(path), "--requests-per-min", "100"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("mi-") and "\n" not in key
    assert _complete(server, key).status_code == 200
    assert _complete(server, key + "x").status_code == 401
