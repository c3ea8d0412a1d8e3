"""`matrixinfer bench pdc`: the colocated engine against the PDC stack, same load on every side.

Each system is a real `matrixinfer serve` subprocess (HTTP, streaming), started and stopped by
the benchmark: `serve --colocated`, and PDC (N prefill + M decode instances + K EMS servers)
with least-loaded and with locality routing. Every system gets the same requests at the same
Poisson arrival times (drawn once from --seed):

- single-turn at 0 %, 50 %, 90 % prefix reuse: each prompt is a prefix shared by all requests
  of the scenario (that fraction of the prompt) plus a suffix of its own;
- the same 50 % and 90 % prompts with the cache off: each request is sent with the key of a
  tenant of its own, and tenants are cache namespaces (local prefix cache and EMS alike), so
  identical tokens are computed again while the hand-off path stays the same;
- multi-turn conversations (chat; each turn resends the history), `bench serve`'s generator.

Per point: TTFT and TPOT p50/p99, goodput under the SLO (TTFT <= --slo-ttft and TPOT <=
--slo-tpot), prefill tokens/s (prompt tokens / TTFT per request, median), and the first
inter-token gap, which in PDC spans the KV hand-off (the decode instance loading the prompt's
blocks from EMS). The report quotes `matrixinfer simulate deployment` on a deployment file
of the same PDC configuration, written beside the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm

from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section
from matrixinfer.bench.serve_bench import (Result, Workload, _workload, load_client, poisson_arrivals, run_multi_turn,
                                           run_prompts, start_server, stop_server, stream_request, summarize)

NAME = "pdc"


@dataclass(frozen=True)
class Scenario:
    name: str
    reuse: float | None  # shared-prefix fraction of a single-turn prompt; None: multi-turn conversations
    cache: bool = True  # False: one tenant (cache namespace) per request


@dataclass
class Plan:
    """The requests of one scenario at one rate, identical for every system."""
    scenario: Scenario
    rate: float
    arrivals: list[float]
    prompts: list[list[int]] | None  # None: multi-turn (the conversation generator makes them)
    seed: int


def scenarios(reuse: list[float]) -> list[Scenario]:
    out = [Scenario(f"single-turn {r:.0%} reuse", r) for r in reuse]
    out += [Scenario(f"single-turn {r:.0%} reuse, cache off", r, cache=False) for r in reuse if r > 0]
    return out + [Scenario("multi-turn", None)]


def systems(args) -> dict[str, list[str]]:
    pdc = ["--prefill-instances", str(args.prefill_instances), "--decode-instances", str(args.decode_instances),
           "--ems-servers", str(args.ems_servers)]
    return {"colocated": ["--colocated"], "pdc least-loaded": pdc + ["--router", "least-loaded"],
            "pdc locality": pdc + ["--router", "locality"]}


def make_plans(args, pool: list[int]) -> list[Plan]:
    rng, plans = random.Random(args.seed), []
    for rate in args.rates:
        for sc in scenarios(args.reuse):
            if sc.reuse is None:
                plans.append(Plan(sc, rate, [], None, rng.randrange(2**31)))
                continue
            n = args.num_requests
            prefix = rng.choices(pool, k=round(sc.reuse * args.input_len))  # a prefix of this point only
            prompts = [prefix + rng.choices(pool, k=args.input_len - len(prefix)) for _ in range(n)]
            plans.append(Plan(sc, rate, poisson_arrivals(rng, rate, n), prompts, rng.randrange(2**31)))
    return plans


class Keys:
    """API keys: one tenant for the cache-on traffic, one per request of the cache-off points
    (the same private tenants on every system: each system is a server of its own)."""

    def __init__(self, db: Path, cache_off_requests: int):
        from matrixinfer.serving.tenants import TenantStore

        self.db, store = db, TenantStore(db)
        self.shared_key = store.add_key("bench")
        self.private = [self._headers(store.add_key(f"bench-private-{i}")) for i in range(cache_off_requests)]
        store.close()
        self.used = 0

    @staticmethod
    def _headers(key: str) -> dict:
        return {"Authorization": f"Bearer {key}"}

    def take(self, n: int) -> list[dict]:
        out, self.used = self.private[self.used:self.used + n], self.used + n
        return out


def run_point(w: Workload, plan: Plan, headers: list[dict] | None, args, bar) -> list[Result]:
    if plan.prompts is None:
        mt = replace(w, input_len=args.turn_len)
        return asyncio.run(run_multi_turn(mt, plan.rate, args.conversations, args.turns, random.Random(plan.seed), bar))
    return asyncio.run(run_prompts(w, plan.arrivals, plan.prompts, bar, headers))


def point_summary(results: list[Result], plan: Plan, duration: float, args) -> dict:
    s = summarize(results, plan.rate, duration)
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= args.slo_ttft and (r.tpot is None or r.tpot <= args.slo_tpot_ms / 1e3)]
    prefill = [r.prompt_tokens / r.ttft for r in ok if r.ttft > 0]
    return s | {"scenario": plan.scenario.name, "reuse": plan.scenario.reuse, "cache": plan.scenario.cache,
                "goodput_req_s": len(good) / duration, "goodput_fraction": len(good) / max(1, len(results)),
                "prefill_tok_s_p50": float(np.median(prefill)) if prefill else None}


async def _unloaded(w: Workload, n: int = 3) -> dict:
    """A warm-up request (first-call costs stay out of the numbers), then n requests one at a
    time: the system's latency without load (medians)."""
    results = []
    async with load_client() as client:
        for i in range(n + 1):
            prompt = random.Random(-1 - i).choices(w.token_pool, k=w.input_len)
            r = await stream_request(client, w, "/v1/completions", {"prompt": prompt})
            if not r.ok:
                raise RuntimeError(f"request without load failed: {r.error}")
            results.append(r)
    def median(attr):
        vals = [getattr(r, attr) for r in results[1:] if getattr(r, attr) is not None]
        return float(np.median(vals)) if vals else None

    return {"ttft_s": median("ttft"), "tpot_s": median("tpot"), "first_gap_s": median("first_gap")}


@dataclass
class System:
    name: str
    server_args: list[str]
    url: str
    start_s: float
    unloaded: dict | None = None

    def report(self, rows: list[dict]) -> dict:
        return {"system": self.name, "server_args": self.server_args, "start_s": self.start_s,
                "unloaded": self.unloaded, "results": rows}


def start_system(name: str, extra: list[str], args, keys: Keys, stack: contextlib.ExitStack) -> System:
    """`matrixinfer serve` for one system; `stack` stops it (always, failure or not)."""
    server_args = extra + ["--max-num-seqs", str(args.max_num_seqs)] + (["--dtype", args.dtype] if args.dtype else [])
    print(f"{name}: starting `matrixinfer serve {' '.join(server_args)}` ...", file=sys.stderr)
    t0 = time.perf_counter()
    proc, url, tmp = start_server(args.model, server_args, keys_db=keys.db)
    stack.callback(stop_server, proc, tmp)
    return System(name, server_args, url, time.perf_counter() - t0)


def run_all(args, chosen: dict[str, list[str]]) -> tuple[list[dict], Workload]:
    """All systems up at once (idle ones cost no CPU); every point runs on each system in
    turn, the order rotating from point to point, so that other load on the machine and its
    drift fall on every system alike."""
    with tempfile.TemporaryDirectory(prefix="mi-bench-pdc-") as tmp, contextlib.ExitStack() as stack:
        n_off = len(args.rates) * sum(1 for s in scenarios(args.reuse) if not s.cache) * args.num_requests
        keys = Keys(Path(tmp) / "keys.db", n_off)
        args.api_key = keys.shared_key  # the workload's key (one tenant for all cache-on traffic)
        sys_list = [start_system(name, extra, args, keys, stack) for name, extra in chosen.items()]
        w = _workload(args, sys_list[0].url)  # same model, same tokenizer on every side
        plans = make_plans(args, w.token_pool)
        for s in sys_list:
            s.unloaded = asyncio.run(_unloaded(replace(w, url=s.url)))
        rows = {s.name: [] for s in sys_list}
        total = len(sys_list) * sum(args.conversations * args.turns if p.prompts is None else len(p.prompts)
                                    for p in plans)
        with tqdm(total=total, desc="bench pdc", file=sys.stderr) as bar:
            for i, plan in enumerate(plans):
                headers = None if plan.scenario.cache else keys.take(len(plan.prompts))
                for s in sys_list[i % len(sys_list):] + sys_list[:i % len(sys_list)]:
                    bar.set_postfix_str(f"{s.name}: {plan.scenario.name} @ {plan.rate:g}/s")
                    t = time.perf_counter()
                    results = run_point(replace(w, url=s.url), plan, headers, args, bar)
                    rows[s.name].append(point_summary(results, plan, time.perf_counter() - t, args))
        return [s.report(rows[s.name]) for s in sys_list], w


# -- the simulator's view of the same PDC configuration ---------------------------------------
# Per-instance parallelism of the paper's CloudMatrix384 deployment (DeepSeek-R1, INT8): a
# prefill instance is 32 NPUs (EP32, SP-TP-SP attention), a decode instance 320 (EP320, INT8
# dispatch, one MTP draft). The "at scale" file keeps the benchmark's instance counts.
AT_SCALE = {"dtype": "int8", "prefill": {"expert_parallel_size": 32, "prefill_parallel": "sp-tp-sp"},
            "decode": {"expert_parallel_size": 320, "dispatch_dtype": "int8", "speculative_num_tokens": 1}}


def deployments(args) -> dict[str, dict]:
    """{file name: deployment}: the PDC configuration measured here, and the same instance
    counts with --sim-scale-model and the paper's per-instance parallelism."""
    model = Path(args.model).resolve()
    try:
        model_ref = str(model.relative_to(Path.cwd()))
    except ValueError:
        model_ref = str(model)
    dtype = args.dtype if args.dtype and args.dtype != "auto" else \
        json.loads((model / "config.json").read_text()).get("torch_dtype", "bfloat16")
    here = {"model": model_ref, "dtype": dtype, "colocated": False, "prefill": {"instances": args.prefill_instances},
            "decode": {"instances": args.decode_instances}, "ems": {"servers": args.ems_servers}}
    out = {f"{NAME}.yaml": here}
    if args.sim_scale_model:
        out[f"{NAME}-at-scale.yaml"] = {**here, "model": args.sim_scale_model, "dtype": AT_SCALE["dtype"],
                                        "prefill": {**here["prefill"], **AT_SCALE["prefill"]},
                                        "decode": {**here["decode"], **AT_SCALE["decode"]}}
    return out


def simulate(args, dep_file: Path) -> dict:
    """`matrixinfer simulate deployment` on the file (its CLI, in a subprocess), at the
    benchmark's highest rate, prompt and output lengths."""
    cmd = [sys.executable, "-m", "matrixinfer.cli", "simulate", "deployment", str(dep_file), "--hardware",
           args.sim_hardware, "--batch", str(args.max_num_seqs), "--kv", str(args.input_len + args.output_len),
           "--prompt", str(args.input_len), "--prefill-tokens", str(args.input_len), "--rate", str(max(args.rates)),
           "--requests", str(args.sim_requests), "--output", str(args.output_len), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    shown = "matrixinfer " + " ".join(cmd[3:-1])
    if out.returncode != 0:
        return {"file": dep_file.name, "command": shown, "error": out.stderr[-1000:]}
    return {"file": dep_file.name, "command": shown, **json.loads(out.stdout)}


def run_simulator(args) -> list[dict]:
    sims = []
    for name, dep in deployments(args).items():
        path = bench_dir() / name
        path.write_text("# written by `matrixinfer bench pdc` (see benchmarks/BENCHMARKS.md, section pdc)\n"
                        + yaml.safe_dump(dep, sort_keys=False))
        sims.append(simulate(args, path))
    return sims


# -- report -------------------------------------------------------------------------------------
def _ms(v):
    return "-" if v is None else 1e3 * v


def _find(rows: list[dict], scenario: str, rate: float) -> dict | None:
    return next((r for r in rows if r["scenario"] == scenario and r["offered_rate"] == rate), None)


def cache_effect(report: dict) -> list[dict]:
    """Per system, rate and reuse level: cache on against the same prompts with the cache off."""
    out = []
    for sysrep in report["systems"]:
        for rate in report["rates"]:
            for reuse in [r for r in report["reuse"] if r > 0]:
                on = _find(sysrep["results"], f"single-turn {reuse:.0%} reuse", rate)
                off = _find(sysrep["results"], f"single-turn {reuse:.0%} reuse, cache off", rate)
                if not on or not off or not on["ttft_p50_s"] or not off["ttft_p50_s"]:
                    continue
                out.append({"system": sysrep["system"], "rate": rate, "reuse": reuse,
                            "cached_fraction": on["cached_fraction"], "ttft_off_s": off["ttft_p50_s"],
                            "ttft_on_s": on["ttft_p50_s"], "ttft_reduction": 1 - on["ttft_p50_s"] / off["ttft_p50_s"],
                            "prefill_off": off["prefill_tok_s_p50"], "prefill_on": on["prefill_tok_s_p50"],
                            "prefill_gain": on["prefill_tok_s_p50"] / off["prefill_tok_s_p50"]})
    return out


def handoff(report: dict) -> list[dict]:
    """First inter-token gap against the steady one (TPOT), single-turn cache-on points pooled
    by median over scenarios."""
    out = []
    for sysrep in report["systems"]:
        for rate in report["rates"]:
            rows = [r for r in sysrep["results"] if r["offered_rate"] == rate and r["reuse"] is not None
                    and r["cache"] and r["first_gap_p50_s"] is not None]
            if not rows:
                continue
            gap50 = float(np.median([r["first_gap_p50_s"] for r in rows]))
            tpot50 = float(np.median([r["tpot_p50_s"] for r in rows]))
            out.append({"system": sysrep["system"], "rate": rate, "first_gap_p50_s": gap50,
                        "first_gap_p99_s": max(r["first_gap_p99_s"] for r in rows), "tpot_p50_s": tpot50,
                        "excess_s": gap50 - tpot50})
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["system"] for s in report["systems"]]
    scen = [s["scenario"] for s in report["systems"][0]["results"] if s["offered_rate"] == report["rates"][0]]
    metrics = (("ttft_p50_s", "TTFT p50 (ms)", 1e3), ("tpot_p50_s", "TPOT p50 (ms)", 1e3),
               ("first_gap_p50_s", "first inter-token gap p50 (ms)", 1e3), ("goodput_fraction", "goodput (%)", 100))
    fig, axes = plt.subplots(len(report["rates"]), len(metrics), figsize=(4.2 * len(metrics), 3.8 * len(report["rates"])),
                             squeeze=False)
    x, width = np.arange(len(scen)), 0.8 / len(names)
    for row, rate in enumerate(report["rates"]):
        for ax, (key, label, scale) in zip(axes[row], metrics):
            for k, sysrep in enumerate(report["systems"]):
                vals = [(_find(sysrep["results"], s, rate) or {}).get(key) for s in scen]
                ax.bar(x + (k - (len(names) - 1) / 2) * width, [scale * v if v is not None else 0 for v in vals],
                       width, label=sysrep["system"])
            ax.set_xticks(x, [s.replace("single-turn ", "").replace(" reuse", "").replace(", cache off", "\noff")
                              for s in scen], fontsize=7)
            ax.set_title(f"{label}, {rate:g} req/s", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['model']}: colocated vs PDC, {report['input_len']} in / {report['output_len']} out tokens, "
                 f"{report['cpu_count']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdict(report: dict) -> list[str]:
    """Where disaggregation pays or not here, from the measured numbers."""
    col = next((s for s in report["systems"] if s["system"] == "colocated"), None)
    if col is None:
        return []
    gaps = {(h["system"], h["rate"]): h for h in report["handoff"]}
    lines = []
    for sysrep in report["systems"]:
        if sysrep is col:
            continue
        for rate in report["rates"]:
            base, pdc = _find(col["results"], "single-turn 0% reuse", rate), _find(sysrep["results"], "single-turn 0% reuse", rate)
            if not base or not pdc or not base["ttft_p50_s"] or not pdc["ttft_p50_s"]:
                continue
            line = (f"- {sysrep['system']} at {rate:g} req/s, 0 % reuse: TTFT p50 {_fmt_ms(pdc['ttft_p50_s'])} vs "
                    f"{_fmt_ms(base['ttft_p50_s'])} colocated (x{pdc['ttft_p50_s'] / base['ttft_p50_s']:.2f}), TPOT p50 "
                    f"{_fmt_ms(pdc['tpot_p50_s'])} vs {_fmt_ms(base['tpot_p50_s'])}, goodput "
                    f"{100 * pdc['goodput_fraction']:.0f} % vs {100 * base['goodput_fraction']:.0f} %")
            g, cg = gaps.get((sysrep["system"], rate)), gaps.get(("colocated", rate))
            if g and cg:
                line += (f"; first inter-token gap p50 {_fmt_ms(g['first_gap_p50_s'])} vs "
                         f"{_fmt_ms(cg['first_gap_p50_s'])} (the hand-off)")
            lines.append(line + ".")
    return lines


def _sub(a, b):
    return None if a is None or b is None else a - b


def _fmt_ms(v) -> str:
    return "-" if v is None else f"{1e3 * v:.1f} ms"


def _sim_rows(sims: list[dict]) -> list[str]:
    rows, errors = [], []
    for sim in sims:
        if "error" in sim:
            errors.append(f"`{sim['command']}` failed: {sim['error']}")
            continue
        p, d, srv = sim["prefill"], sim["decode"], sim.get("serve", {})
        rows.append([f"[{sim['file']}]({sim['file']})", sim["model"], sim["devices"],
                     f"{1e3 * p['ttft_s']:.3g}" if p.get("fits") else "does not fit",
                     f"{d['tpot_ms']:.3g}" if d.get("fits") else "does not fit",
                     f"{1e3 * srv['ttft_p50_s']:.3g}" if srv else "-", f"{1e3 * srv['ttft_p99_s']:.3g}" if srv else "-",
                     f"{srv['tpot_p50_ms']:.3g}" if srv else "-", f"{srv['tpot_p99_ms']:.3g}" if srv else "-"])
    table = markdown_table(["file", "model", "devices", "prefill TTFT ms (one prompt)", "decode TPOT ms",
                            "DES TTFT p50 ms", "DES TTFT p99 ms", "DES TPOT p50 ms", "DES TPOT p99 ms"], rows)
    cmds = [f"`{sim['command']}`" for sim in sims if "error" not in sim]
    return ([table, "", "Commands: " + "; ".join(cmds) + "."] if rows else []) + errors


def _load_note(report: dict) -> list[str]:
    load, cores = report["loadavg_5min"]["before"], report["cpu_count"]
    if load < 0.5 * cores:
        return []
    return [f"**Caveat**: before this run the machine was already busy with other work (5-minute load average "
            f"{load:.1f} on {cores} cores), so each system got a varying fraction of the CPU: the latencies below "
            "measure that contention as much as the systems (the latencies without load below already include it), "
            "and single points swing with it. Rotating the order spreads the drift over the systems "
            "but cannot remove it; rerun on an idle machine for numbers to compare closely.", ""]


def _router_note(report: dict) -> list[str]:
    if report["prefill_instances"] > 1 or report["decode_instances"] > 1:
        return []
    return ["With one prefill and one decode instance the routers have nothing to choose between (every request "
            "goes to prefill-0, then decode-0): the two PDC systems are the same stack, and the difference between "
            "their rows is run-to-run noise on this shared machine, a noise floor for every other comparison here. "
            "Give `--prefill-instances 2` (or more) to compare routing.", ""]


def write_markdown(report: dict, plot: Path) -> None:
    slo = report["slo"]
    md = ["## Prefill / decode / caching disaggregation (`matrixinfer bench pdc`)", "",
          f"The same requests (Poisson arrivals, seed {report['seed']}) against `matrixinfer serve` processes "
          "started by the benchmark, all up at once (idle ones take no CPU), each point run on every system in "
          "turn with the order rotating from point to point, so that other load on the machine falls on every "
          f"side alike: `--colocated`, and PDC ({report['prefill_instances']} prefill + "
          f"{report['decode_instances']} decode instance(s), {report['ems_servers']} EMS server(s), KV hand-off through "
          "EMS) with least-loaded and with locality routing. Model "
          f"`{report['model']}`, {report['input_len']}-token prompts, {report['output_len']} output tokens "
          f"(ignore_eos), {report['num_requests']} requests per single-turn point; multi-turn: "
          f"{report['conversations']} conversations of {report['turns']} turns, ~{report['turn_len']} tokens per user "
          f"message. {report['cpu_count']} CPU cores shared by every process of a system and by whatever else runs "
          f"on the machine (5-minute load average {report['loadavg_5min']['before']:.1f} before the run, "
          f"{report['loadavg_5min']['at_end']:.1f} at its end, this run included). Server start (s): "
          + ", ".join(f"{s['system']} {s['start_s']:.1f}" for s in report["systems"]) + ".", "",
          f"**SLO** for goodput: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_ms']:g} ms. {slo['why']}", "",
          "**Cache off** points send the same prompts, each with the API key of a tenant of its own: tenants are "
          "cache namespaces (local prefix cache and EMS), so nothing is reused but every other path (hand-off "
          "included) is the same.", "",
          ] + _load_note(report) + ["### Latency and goodput", ""] + _router_note(report) + [

          markdown_table(["system", "req/s", "scenario", "done", "cached %", "TTFT p50 ms", "TTFT p99 ms",
                          "TPOT p50 ms", "TPOT p99 ms", "1st gap p50 ms", "goodput %", "goodput req/s"],
                         [[s["system"], r["offered_rate"], r["scenario"], f"{r['completed']}/{r['requests']}",
                           100 * r["cached_fraction"], _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]), _ms(r["tpot_p50_s"]),
                           _ms(r["tpot_p99_s"]), _ms(r["first_gap_p50_s"]), 100 * r["goodput_fraction"],
                           r["goodput_req_s"]] for s in report["systems"] for r in s["results"]]),
          "", "### Context cache: the same prompts with the cache on and off", "",
          "Prefill tokens/s is a request's prompt tokens over its TTFT (median over the point).", "",
          markdown_table(["system", "req/s", "reuse", "cached %", "TTFT p50 off ms", "TTFT p50 on ms",
                          "TTFT reduction %", "prefill tok/s off", "prefill tok/s on", "gain x"],
                         [[c["system"], c["rate"], f"{c['reuse']:.0%}", 100 * c["cached_fraction"], _ms(c["ttft_off_s"]),
                           _ms(c["ttft_on_s"]), 100 * c["ttft_reduction"], c["prefill_off"], c["prefill_on"],
                           c["prefill_gain"]] for c in report["cache_effect"]]),
          "", "### Hand-off latency", "",
          "The first inter-token gap as the client sees it: in PDC it spans the hand-off (the prefill instance "
          "returns the first token, the decode instance loads the prompt's blocks from EMS and computes the tail); "
          "colocated it is an ordinary decode step. Medians over the single-turn cache-on points; excess = gap - TPOT.",
          "", markdown_table(["system", "req/s", "1st gap p50 ms", "1st gap p99 ms (max over points)", "TPOT p50 ms",
                              "excess ms"],
                             [[h["system"], h["rate"], _ms(h["first_gap_p50_s"]), _ms(h["first_gap_p99_s"]),
                               _ms(h["tpot_p50_s"]), _ms(h["excess_s"])] for h in report["handoff"]]),
          "", "Without load (one request at a time, median of 3), where nothing queues:", "",
          markdown_table(["system", "TTFT ms", "1st gap ms", "TPOT ms", "excess ms"],
                         [[s["system"], _ms(s["unloaded"]["ttft_s"]), _ms(s["unloaded"]["first_gap_s"]),
                           _ms(s["unloaded"]["tpot_s"]), _ms(_sub(s["unloaded"]["first_gap_s"], s["unloaded"]["tpot_s"]))]
                          for s in report["systems"]]),
          "", f"![colocated vs PDC]({plot.name})", "",
          "### Where disaggregation does not pay here", "",
          "Prefill and decode instances are separate processes on the same "
          f"{report['cpu_count']} cores, so PDC adds work (a second engine, the EMS round trip of every prompt's "
          "blocks, the hand-off) without adding compute, and the prefill/decode interference it removes is "
          "replaced by contention for the same cores (each instance's worker sizes its torch thread pool to every "
          "core of the machine, so two pools share them):", ""] + _verdict(report) + [
          "", "### What the simulator predicts for the same configuration", "",
          f"`matrixinfer simulate deployment` on {report['sim_hardware']}, at the highest offered rate and the same "
          f"prompt and output lengths: first the configuration measured here ({report['prefill_instances']} prefill + "
          f"{report['decode_instances']} decode instance(s), one device each), then the same instance counts at the "
          "paper's scale (its model and per-instance parallelism: prefill EP32 with SP-TP-SP attention, decode "
          "EP320 with INT8 dispatch and one MTP draft). There every role has devices of its own, so the interference "
          "above is gone, and the hand-off is a transfer over the supernode's memory fabric.", ""] + _sim_rows(
              report["simulator"])
    write_section(NAME, "\n".join(md))


def slo_why(report: dict, args) -> str:
    alone = ", ".join(f"{s['system']} {_fmt_ms(s['unloaded']['ttft_s'])} / {_fmt_ms(s['unloaded']['tpot_s'])}"
                      for s in report["systems"])
    return (f"Why: without load (one request at a time, median of 3) TTFT / TPOT for a {args.input_len}-token prompt "
            f"here are {alone}; the SLO leaves several times that for queueing and the hand-off on "
            f"{report['cpu_count']} shared cores, so a miss means contention or a slow path rather than the model's "
            f"base speed, and {args.slo_ttft:g} s to the first token with {1e3 / args.slo_tpot_ms:.0f} tokens/s per "
            "stream is still what a chat user perceives as prompt.")


def main(args) -> int:
    all_systems = systems(args)
    chosen = {k: v for k, v in all_systems.items() if k in args.systems} if args.systems else all_systems
    load_before = os.getloadavg()[1]
    rows, w = run_all(args, chosen)
    load_during = os.getloadavg()[1]  # 5-minute averages: the machine's busyness, this run's own load included
    report = {"model": w.model, "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
              "rates": args.rates, "reuse": args.reuse, "num_requests": args.num_requests,
              "conversations": args.conversations, "turns": args.turns, "turn_len": args.turn_len,
              "prefill_instances": args.prefill_instances, "decode_instances": args.decode_instances,
              "ems_servers": args.ems_servers, "max_num_seqs": args.max_num_seqs, "cpu_count": os.cpu_count(),
              "loadavg_5min": {"before": load_before, "at_end": load_during},
              "slo": {"ttft_s": args.slo_ttft, "tpot_ms": args.slo_tpot_ms}, "systems": rows}
    report["slo"]["why"] = slo_why(report, args)
    report["cache_effect"], report["handoff"] = cache_effect(report), handoff(report)
    report["sim_hardware"], report["simulator"] = args.sim_hardware, run_simulator(args)
    save_json(NAME, report)
    plot = bench_dir() / f"{NAME}.png"
    _plot(report, plot)
    write_markdown(report, plot)
    if args.json:
        print(json.dumps(report))
    failed = sum(r["failed"] for s in rows for r in s["results"])
    return 0 if failed == 0 else 1
