"""`matrixinfer bench pdc` (the colocated engine against the PDC stack; pdc_bench.py runs it) and
`matrixinfer bench make-model` (make_model.py: a random checkpoint of a real model's shapes),
`matrixinfer bench quant` / `int8-gemm` (quant_bench.py: the INT8 ablation and GEMM),
`matrixinfer bench ems` (ems_bench.py and its variants)."""

from __future__ import annotations

from matrixinfer.config import DEFAULT_MODEL


def _bench_pdc(args) -> int:
    from matrixinfer.bench.pdc_bench import main

    return main(args)


def _bench_ems(args) -> int:
    # each variant is a module of its own beside ems_bench.py (they share its timers)
    if args.huge_pages:
        from matrixinfer.bench.ems_hugepages_bench import run_hugepages_bench

        return run_hugepages_bench(args)
    if args.replicas:
        from matrixinfer.bench.ems_replicas_bench import run_replicas_bench

        return run_replicas_bench(args)
    from matrixinfer.bench.ems_bench import run_bench

    return run_bench(args)


def _register_ems(bench_sub) -> None:
    b = bench_sub.add_parser("ems", help="EMS vs Redis put/get; model cache vs direct loading")
    b.add_argument("--quick", action="store_true", help="smaller sweep (smoke test)")
    b.add_argument("--name", default="ems", help="<out dir>/<name>.json (only 'ems' updates BENCHMARKS.md)")
    b.add_argument("--huge-pages", action="store_true", help="measure the same-host get path with the arena on huge "
                   "pages and without, instead")
    b.add_argument("--replicas", type=int, default=0, help="N >= 2: measure a namespace with N copies side by side "
                   "with one copy (put/get latency, pool bytes, misses and re-replication after a kill -9), instead")
    b.set_defaults(func=_bench_ems)


def register(sub, bench_sub) -> None:
    from matrixinfer.bench import make_model, quant_bench

    _register_ems(bench_sub)
    make_model.register(bench_sub)
    quant_bench.register(bench_sub)
    p = bench_sub.add_parser("pdc", help="same load against `serve --colocated` and the PDC stack (two routers)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--systems", nargs="+", default=None,
                   choices=["colocated", "pdc least-loaded", "pdc locality"], help="a subset (default: all three)")
    p.add_argument("--prefill-instances", type=int, default=1)
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument("--ems-servers", type=int, default=1)
    p.add_argument("--rates", type=float, nargs="+", default=[1.5], help="offered loads, requests (conversations)/s")
    p.add_argument("--reuse", type=float, nargs="+", default=[0.0, 0.5, 0.9],
                   help="single-turn shared-prefix fractions (each > 0 also runs with the cache off)")
    p.add_argument("--num-requests", type=int, default=24, help="requests per single-turn point")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (single-turn)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--conversations", type=int, default=6, help="conversations per multi-turn point")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=64, help="tokens (about) per user message, multi-turn")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="goodput SLO: time to first token, s")
    p.add_argument("--slo-tpot-ms", type=float, default=25.0, help="goodput SLO: time per output token, ms")
    p.add_argument("--sim-hardware", default="cloudmatrix384", help="for `simulate deployment` on the same configuration")
    p.add_argument("--sim-requests", type=int, default=500)
    p.add_argument("--sim-scale-model", default="deepseek-r1",
                   help="also simulate the same instance counts with this model at the paper's scale ('' = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.set_defaults(func=_bench_pdc)
