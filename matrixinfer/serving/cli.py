"""`matrixinfer serve`, `matrixinfer keys add|list|revoke`, `matrixinfer usage` and
`matrixinfer bench serve`."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

from matrixinfer.config import DEFAULT_MODEL, EngineConfig
from matrixinfer.serving.ledger import Prices
from matrixinfer.serving.reasoning import REASONING_PARSERS
from matrixinfer.serving.db import DEFAULT_DB
from matrixinfer.serving.tenants import PERIODS


def _serve(args) -> int:
    import uvicorn

    from matrixinfer.serving import AsyncLLMEngine, TenantStore, UsageLedger, build_app
    from matrixinfer.serving.drain import DrainingServer

    if args.deployment:  # each role from its section of the file; the flags fill in the rest
        from matrixinfer.deployment import load_deployment

        dep = load_deployment(args.deployment)
        roles = EngineConfig.for_roles(dep, **EngineConfig.cli_kwargs(args))
        args.colocated = dep.colocated
        if not dep.colocated:
            args.prefill_instances, args.decode_instances = dep.prefill.instances, dep.decode.instances
            args.ems_servers, args.ems_replicas = max(1, dep.ems_servers), dep.ems_replicas
    else:
        config = EngineConfig.from_cli(args)
        roles = {"prefill": config, "decode": config}
    if args.colocated:
        engine = AsyncLLMEngine(roles["decode"], model_name=args.served_model_name)
        layouts = {"instance": roles["decode"]}
    else:
        from matrixinfer.pdc import start_pdc

        engine = start_pdc(roles["prefill"], args.prefill_instances, args.decode_instances, args.ems_servers,
                           args.ems_controller, args.router, args.served_model_name, ray_address=args.ray_address,
                           decode=roles["decode"], ems_replicas=args.ems_replicas)
        layouts = {"prefill": engine.prefill[0].config, "decode": engine.decode[0].config}
        print(f"matrixinfer: PDC stack: {args.prefill_instances} prefill + {args.decode_instances} decode instance(s), "
              f"KV hand-off through EMS ({args.ems_controller or f'{args.ems_servers} local MP server(s)'}), "
              f"router {args.router}", file=sys.stderr)
    for role, cfg in layouts.items():  # what each role actually runs, after the launcher's adjustments
        print(f"matrixinfer: {role}: {cfg.layout()}", file=sys.stderr)
    tenants, ledger = TenantStore(args.keys_db), UsageLedger(args.ledger_db or args.keys_db)
    app = build_app(engine, tenants, ledger, own_engine=True, reasoning_parser=args.reasoning_parser)
    print(f"matrixinfer: serving {engine.model_name} (context {engine.max_model_len} tokens) on "
          f"http://{args.host}:{args.port}/v1; usage ledger {ledger.path}", file=sys.stderr)
    if not tenants.has_keys():
        print(f"matrixinfer: no API keys in {tenants.path}: serving WITHOUT authentication, every request is "
              "metered as tenant 'anonymous' (make a key with `matrixinfer keys add --tenant NAME`)", file=sys.stderr)
    # SIGTERM/SIGINT: drain (503 to new requests, in-flight streams finish up to
    # --shutdown-timeout), then the app's lifespan shuts the engine down; exit 0.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=1)
    DrainingServer(config, app.state.drain, args.shutdown_timeout).run()
    return 0


def _limits(args) -> dict:
    names = ["input_tokens_per_period", "output_tokens_per_period", "requests_per_min", "tokens_per_min", "period"]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _keys_add(args) -> int:
    from matrixinfer.serving.tenants import TenantStore

    store = TenantStore(args.keys_db)
    key = store.add_key(args.tenant, **_limits(args))
    print(key)
    print(f"key for tenant {args.tenant!r} stored (hashed) in {store.path}; it is not shown again: "
          f"{store.tenant(args.tenant)}", file=sys.stderr)
    return 0


def _keys_list(args) -> int:
    from matrixinfer.bench.report import markdown_table
    from matrixinfer.serving.tenants import TenantStore

    store = TenantStore(args.keys_db)
    rows = [[prefix + "...", tenant, datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%d %H:%M"),
             "revoked" if revoked else "active"] for prefix, tenant, created, revoked in store.list_keys()]
    print(markdown_table(["key", "tenant", "created (UTC)", "state"], rows))
    return 0


def _keys_revoke(args) -> int:
    from matrixinfer.serving.tenants import TenantStore

    n = TenantStore(args.keys_db).revoke(args.prefix.removesuffix("..."))
    print(f"revoked {n} key(s)", file=sys.stderr)
    return 0 if n else 1


def parse_date(text: str) -> float:
    """YYYY-MM-DD or an ISO 8601 time (UTC when no zone is given) -> epoch seconds."""
    t = datetime.fromisoformat(text)
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def _usage(args) -> int:
    from matrixinfer.bench.report import markdown_table
    from matrixinfer.serving.ledger import UsageLedger

    prices = Prices(args.price_input, args.price_cached_input, args.price_output)
    totals = UsageLedger(args.ledger_db or args.keys_db).totals(args.tenant, parse_date(args.since) if args.since else None)
    if args.json:
        print(json.dumps([{**t.__dict__, "cost_usd": t.cost(prices)} for t in totals]))
        return 0
    rows = [[t.tenant, t.model, t.requests, t.input_tokens, t.cached_input_tokens, t.output_tokens,
             f"{t.cost(prices):.6f}"] for t in totals]
    print(markdown_table(["tenant", "model", "requests", "input tokens", "cached input", "output tokens", "cost USD"],
                         rows))
    print(f"\nprices per million tokens: input {prices.input}, cached input {prices.cached_input}, "
          f"output {prices.output} USD" + (f"; since {args.since}" if args.since else ""))
    return 0


def _bench_serve(args) -> int:
    from matrixinfer.bench.serve_bench import main

    return main(args)


def _db_args(p) -> None:
    p.add_argument("--keys-db", default=str(DEFAULT_DB), help="SQLite file of tenants and keys (default %(default)s)")
    p.add_argument("--ledger-db", default=None, help="SQLite file of the usage ledger (default: the keys db)")


def register(sub, bench_sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible token service (completions, chat, metering)")
    s.add_argument("--model", default=DEFAULT_MODEL)
    s.add_argument("--served-model-name", default=None, help="model id in the API (default: the directory name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    _db_args(s)
    EngineConfig.add_cli_args(s)
    s.add_argument("--colocated", action="store_true",
                   help="one instance does prefill and decode (no PDC roles, no EMS needed)")
    s.add_argument("--prefill-instances", type=int, default=1)
    s.add_argument("--decode-instances", type=int, default=1)
    s.add_argument("--ems-servers", type=int, default=1,
                   help="EMS MP servers to start for the KV hand-off (ignored with --ems-controller)")
    s.add_argument("--ems-replicas", type=int, default=1,
                   help="copies of each object of the stack's EMS namespaces (KV, model cache) on distinct MP "
                        "servers: with 2, a dead server costs no cache miss")
    s.add_argument("--ray-address", default=None,
                   help="auto or HOST:PORT: place the instances and EMS servers as actors on that Ray cluster")
    s.add_argument("--router", default="least-loaded", choices=["least-loaded", "locality", "round-robin"],
                   help="the peer scheduler's policy")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split chat answers into reasoning_content (the text before </think>) and content")
    s.add_argument("--log-level", default="warning")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds that requests in flight may take to finish (new ones get 503)")
    s.set_defaults(func=_serve)

    k = sub.add_parser("keys", help="API keys of tenants")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    add = ksub.add_parser("add", help="make a key for a tenant (printed once) and set the tenant's limits")
    add.add_argument("--tenant", required=True)
    _db_args(add)
    add.add_argument("--input-tokens-per-period", type=int, default=None, help="quota of prompt tokens")
    add.add_argument("--output-tokens-per-period", type=int, default=None, help="quota of completion tokens")
    add.add_argument("--period", choices=PERIODS, default=None, help="quota period (UTC calendar; default day)")
    add.add_argument("--requests-per-min", type=int, default=None)
    add.add_argument("--tokens-per-min", type=int, default=None)
    add.set_defaults(func=_keys_add)
    ls = ksub.add_parser("list", help="list keys (prefixes only)")
    _db_args(ls)
    ls.set_defaults(func=_keys_list)
    rv = ksub.add_parser("revoke", help="revoke the key with this prefix")
    rv.add_argument("prefix")
    _db_args(rv)
    rv.set_defaults(func=_keys_revoke)

    u = sub.add_parser("usage", help="metered usage per tenant and model, with cost")
    u.add_argument("--tenant", default=None)
    u.add_argument("--since", default=None, help="YYYY-MM-DD or ISO time (UTC)")
    _db_args(u)
    d = Prices()
    u.add_argument("--price-input", type=float, default=d.input, help="USD per million uncached input tokens")
    u.add_argument("--price-cached-input", type=float, default=d.cached_input, help="USD per million cached input tokens")
    u.add_argument("--price-output", type=float, default=d.output, help="USD per million output tokens")
    u.add_argument("--json", action="store_true")
    u.set_defaults(func=_usage)

    b = bench_sub.add_parser("serve", help="online load (Poisson arrivals) against the token service")
    from matrixinfer.bench.serve_bench import add_arguments

    add_arguments(b)
    b.set_defaults(func=_bench_serve)
