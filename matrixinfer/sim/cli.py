"""CLI subcommands of this subsystem (registered by matrixinfer.cli).

matrixinfer simulate decode|prefill|serve|faults|dispatch|allocation|calibrate|paper-tables
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, replace

from tqdm import tqdm

from matrixinfer.bench.report import markdown_table

DECODE_PLOT = "docs/img/sim_decode_tpot.png"
ALLOC_PLOT = "docs/img/sim_allocation.png"
FAULTS_PLOT = "docs/img/sim_faults.png"
ALLOC_SIZES = [192, 224, 384, 768, 2048, 8192]
ALLOC_MEANS = [2, 4, 6, 8, 10.08, 11.28, 14, 18, 24]


def _specs(args):
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model

    return load_hardware(args.hardware), load_model(args.model)


def _common(p: argparse.ArgumentParser, default_hw: str = "cloudmatrix384") -> None:
    p.add_argument("--hardware", default=default_hw, help="bundled name (cloudmatrix384, h800, h100, "
                   "supernode8192) or a YAML path")
    p.add_argument("--model", default="deepseek-r1", help="bundled name or a HF config.json path")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


# ---------------------------------------------------------------- decode

def _decode_cfg(args, batch):
    from matrixinfer.sim.costs import eplb_imbalance, zipf_loads
    from matrixinfer.sim.decode import DecodeConfig

    imbalance = args.imbalance
    if args.expert_skew:
        _, model = _specs(args)
        slots = args.ep - (args.shared_devices if args.shared_devices is not None else args.ep // 10)
        imbalance = eplb_imbalance(zipf_loads(model.routed_experts, args.expert_skew), max(slots, model.routed_experts))
    return DecodeConfig(batch_per_device=batch, kv_len=args.kv, ep=args.ep, weight_precision=args.precision,
                        dispatch_precision=args.dispatch_precision or args.precision, mtp_drafts=args.mtp,
                        mtp_acceptance=args.accept, microbatches=args.microbatches,
                        shared_expert_devices=args.shared_devices, expert_imbalance=imbalance,
                        pipelined_mtp=not args.no_pipelined_mtp)


def cmd_decode(args) -> int:
    from matrixinfer.sim.decode import decode_step, layer_paths_us

    hw, model = _specs(args)
    batches = args.sweep or [args.batch]
    rows, out = [], []
    for b in batches:
        cfg = _decode_cfg(args, b)
        r = decode_step(hw, model, cfg)
        out.append({"batch_per_device": b, "step_ms": r.step_ms, "tpot_ms": r.tpot_ms,
                    "tokens_per_s_per_npu": r.tokens_per_s_per_device, "breakdown_ms": r.breakdown_ms,
                    "layer_paths_us": layer_paths_us(hw, model, cfg)})
        rows.append([b, r.step_ms, r.tpot_ms, r.tokens_per_s_per_device, cfg.expert_imbalance])
    if args.plot:
        _decode_plot(args.plot)
    if args.json:
        print(json.dumps({"hardware": hw.name, "model": model.name, "results": out}, indent=2))
        return 0
    print(f"decode on {hw.name}, {model.name}, EP{args.ep}, {args.precision}, KV {args.kv:g}, "
          f"MTP {args.mtp} @ {args.accept:g}, overlap efficiency {hw.efficiency.overlap:g}\n")
    print(markdown_table(["batch/device", "step ms", "TPOT ms", "tokens/s per device", "expert imbalance"], rows))
    paths = out[-1]["layer_paths_us"]
    print("\none MoE layer, one microbatch (us): " + ", ".join(f"{k} {v:.0f}" for k, v in paths.items()))
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


def decode_curves(batches=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160)) -> dict:
    from matrixinfer.sim.decode import DecodeConfig, decode_step
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model
    from matrixinfer.sim.scenarios import H800_DECODE

    model = load_model("deepseek-r1")
    cm, h8 = load_hardware("cloudmatrix384"), load_hardware("h800")
    variants = {
        "CloudMatrix384 EP320 INT8, MTP 1 @ 70 %": (cm, {}),
        "CloudMatrix384 EP320 INT8, no MTP": (cm, {"mtp_drafts": 0}),
        "CloudMatrix384 EP320 INT8, one microbatch": (cm, {"microbatches": 1}),
        "H800 EP128 FP8, MTP 1 @ 70 %": (h8, dict(H800_DECODE)),
    }
    curves = {}
    for label, (hw, kw) in variants.items():
        pts = []
        for b in batches:
            r = decode_step(hw, model, DecodeConfig(batch_per_device=b, kv_len=4096, **kw))
            pts.append((b, r.tpot_ms, r.tokens_per_s_per_device))
        curves[label] = pts
    return curves


def _decode_plot(path: str) -> None:
    from matrixinfer.sim.plots import plot_decode_tradeoff

    plot_decode_tradeoff(decode_curves(), path, marks={"measured (calibration)": (49.4, 1943)})


# ---------------------------------------------------------------- prefill

def cmd_prefill(args) -> int:
    from matrixinfer.sim.prefill import PrefillConfig, prefill_balance, prefill_batch

    hw, model = _specs(args)
    cfg = PrefillConfig(tokens_per_device=args.tokens, prompt_len=args.prompt, devices=args.devices, ep=args.ep,
                        attention=args.attention, weight_precision=args.precision,
                        dispatch_precision=args.precision, cache_hit=args.cache_hit, page_plane=args.page_plane,
                        hierarchical_ep=hw.scale_up.domain < args.ep)
    r = prefill_batch(hw, model, cfg)
    result = {"batch_s": r.batch_s, "kv_load_s": r.kv_load_s, "ttft_s": r.ttft_s,
              "tokens_per_s_per_npu": r.tokens_per_s_per_device, "breakdown_s": r.breakdown_s}
    if args.compare_dp:
        rng = random.Random(args.seed)
        n = max(1, round(args.tokens * args.devices / args.prompt))
        lengths = [max(16, min(4 * args.prompt, round(rng.lognormvariate(math.log(args.prompt) - 0.5 * args.sigma**2,
                                                                          args.sigma)))) for _ in range(n)]
        bal = prefill_balance(hw, model, lengths, args.devices, weight_precision=args.precision,
                              dispatch_precision=args.precision)
        result["dp_vs_sptp"] = asdict(bal) | {"prompts": n, "sigma": args.sigma}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"prefill on {hw.name}, {model.name}, {args.attention}, {args.devices} devices, EP{args.ep}, "
          f"{args.tokens} tokens/device of {args.prompt}-token prompts, cache hit {args.cache_hit:g} "
          f"over {args.page_plane}\n")
    print(markdown_table(["batch s", "KV load s", "TTFT s", "tokens/s per device"],
                         [[r.batch_s, r.kv_load_s, r.ttft_s, r.tokens_per_s_per_device]]))
    if args.compare_dp:
        b = result["dp_vs_sptp"]
        print(f"\nmixed lengths (lognormal sigma {args.sigma}): DP {b['dp_s']:.3f} s "
              f"(balance {b['dp_efficiency']:.2f}) vs SP-TP-SP {b['sptp_s']:.3f} s: {b['speedup']:.2f}x")
    return 0


# ---------------------------------------------------------------- serve (DES)

def cmd_serve(args) -> int:
    from matrixinfer.sim.serving import CostModelTimes, ServingConfig, load_trace, poisson_requests, simulate

    hw, model = _specs(args)
    if args.trace:
        reqs = load_trace(args.trace)
    else:
        reqs = poisson_requests(args.rate, args.requests, args.prompt, args.output, seed=args.seed,
                                prefixes=args.prefixes, prefix_len=args.prefix_len)
    cfg = ServingConfig(prefill_instances=args.prefill_instances, decode_instances=args.decode_instances,
                        prefill_devices=args.prefill_devices, decode_devices=args.decode_devices,
                        max_batch_per_device=args.max_batch, ems_capacity_tokens=args.ems_capacity,
                        mtp_drafts=args.mtp, mtp_acceptance=args.accept, seed=args.seed,
                        sample_dt=args.sample_dt, prefill_chunk_tokens=args.chunk_tokens)
    times = CostModelTimes(hw, model, cfg)
    with tqdm(total=len(reqs), desc="requests", unit="req", disable=args.json) as bar:
        res = simulate(reqs, cfg, times.prefill_time, times.decode_time, times.kv_bytes_per_token(),
                       progress=bar.update)
    s = res.summary()
    if args.plot:
        from matrixinfer.sim.plots import plot_utilisation

        plot_utilisation(res.utilisation, args.plot)
    if args.json:
        print(json.dumps({"summary": s, "utilisation": res.utilisation}, indent=2))
        return 0
    print(f"\nPDC on {hw.name}: {cfg.prefill_instances} prefill x {cfg.prefill_devices} + "
          f"{cfg.decode_instances} decode x {cfg.decode_devices} devices, {len(reqs)} requests\n")
    print(markdown_table(list(s), [list(s.values())]))
    if args.plot:
        print(f"\nutilisation plot: {args.plot}")
    return 0


# ---------------------------------------------------------------- faults

def _fault_schedule(args):
    from matrixinfer.sim.faults import FaultKind, FaultSchedule, load_schedule, parse_event

    inst = dict(detect_s=args.detect_s, recover_s=args.recover_s)
    sch = FaultSchedule(npu=FaultKind(args.npu_mtbf_h, **inst), link=FaultKind(args.link_mtbf_h, **inst),
                        node=FaultKind(args.node_mtbf_h, **inst),
                        ems=FaultKind(args.ems_mtbf_h, args.ems_detect_s, args.ems_recover_s),
                        events=tuple(parse_event(e) for e in args.event or ()), horizon_s=args.horizon,
                        seed=args.seed)
    return load_schedule(args.faults, sch) if args.faults else sch


def cmd_faults(args) -> int:
    from matrixinfer.sim.fault_study import Load, Study, compare, parse_layout
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model
    from matrixinfer.sim.serving import ServingConfig

    model = load_model(args.model)
    sch = _fault_schedule(args)
    layouts = [parse_layout(x) for x in args.layouts]
    pn, pd = parse_layout(args.prefill)
    base = ServingConfig(prefill_instances=pn, prefill_devices=pd, max_batch_per_device=args.max_batch,
                         ems_capacity_tokens=args.ems_capacity, ems_servers=args.ems_servers, mtp_drafts=args.mtp,
                         mtp_acceptance=args.accept, seed=args.seed, sample_dt=args.sample_dt)
    study = Study(Load(args.rate, args.prompt, args.output, args.prefixes, args.prefix_len, args.seed),
                  args.warmup, args.ttft_slo_s, args.tpot_slo_ms)
    n_req = max(1, round(args.rate * sch.horizon_s))
    rows = []
    with tqdm(total=2 * n_req * len(layouts) * len(args.hardware), desc="requests", unit="req",
              disable=args.json) as bar:
        for name in args.hardware:
            rows += compare(load_hardware(name), model, base, layouts, sch, study, args.ems_recover_s, bar.update)
    if args.plot:
        from matrixinfer.sim.plots import plot_faults

        labels = [f"{r['hardware']}, {r['layout']}" for r in rows]
        plot_faults({lb: r["faults"]["series"] for lb, r in zip(labels, rows)},
                    {lb: r["faults"]["log"] for lb, r in zip(labels, rows)}, args.plot,
                    window=(args.warmup, sch.horizon_s))
    if args.json:
        for r in rows:
            for k in ("free", "faults"):
                r[k].pop("series")
        print(json.dumps({"schedule": asdict(sch), "rows": rows}, default=str))
        return 0
    f0 = rows[0]["faults"]
    print(f"\n{model.name}, prefill {pn} x {pd} devices, {args.rate:g} req/s of {args.prompt} + {args.output} tokens "
          f"({args.prefixes} prefixes of {args.prefix_len}, EMS {args.ems_capacity:,} tokens over {args.ems_servers} "
          f"servers), {sch.horizon_s:g} s, window from {args.warmup:g} s")
    print(f"faults: MTBF per component (h) npu {sch.npu.mtbf_h:g}, link {sch.link.mtbf_h:g}, node {sch.node.mtbf_h:g}, "
          f"ems {sch.ems.mtbf_h:g}, explicit {len(sch.events)}, seed {sch.seed}; detection {sch.npu.detect_s:g} s "
          f"(EMS {sch.ems.detect_s:g} s); SLO TTFT <= {args.ttft_slo_s:g} s and TPOT <= {args.tpot_slo_ms:g} ms\n")
    table = []
    for r in rows:
        f, h = r["free"], r["faults"]
        dec = h["instance_failures"]["decode"]
        table.append([r["hardware"], r["layout"], f"{h['faults']} / {dec} / {h['instance_failures']['prefill']}",
                      f"{h['recover_s']['decode']:.1f}", f"{h['instance_s_down']['decode']:.1f}",
                      f"{h['instance_s_down']['decode'] * r['decode_devices']:.0f}",
                      f"{h['tokens_recomputed'] / 1e6:.2f}",
                      f"{h['recomputed']['decode'] / dec / 1e6:.2f}" if dec else "-",
                      f"{f['goodput_tok_s']:.0f}", f"{h['goodput_tok_s']:.0f}", f"{100 * r['goodput_lost']:.2f} %",
                      f"{100 * f['slo']['both']:.1f} %", f"{100 * h['slo']['both']:.1f} %"])
    print(markdown_table(["hardware", "decode", "faults / decode hit / prefill hit", "rebuild s", "decode inst-s down",
                          "decode device-s down", "tokens recomputed (M)", "M per decode failure",
                          "goodput fault-free", "goodput", "goodput lost", "SLO fault-free", "SLO"], table))
    print(f"\nrebuild = {f0['recover_s']['decode']:.2f} s restart + weight reload per decode instance "
          f"(prefill {f0['recover_s']['prefill']:.2f} s, EMS server {f0['recover_s']['ems']:g} s), after detection")
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


# ---------------------------------------------------------------- dispatch / combine

def cmd_dispatch(args) -> int:
    from matrixinfer.sim.costs import ep_comm

    hw, model = _specs(args)
    rows, out = [], {}
    for ep in args.ep:
        c = ep_comm(hw, model, args.tokens, ep, args.precision, "bf16", plane=hw.ep_decode_plane, dedup_ranks=False)
        out[ep] = {"dispatch_us": c.dispatch_s * 1e6, "combine_us": c.combine_s * 1e6,
                   "dispatch_gb_s": c.dispatch_bytes / c.dispatch_s / 1e9, "combine_gb_s": c.combine_bytes / c.combine_s / 1e9}
        rows.append([ep, *out[ep].values()])
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"dispatch ({args.precision}) / combine (bf16) on {hw.name} over {hw.plane(hw.ep_decode_plane).name}, "
          f"{args.tokens} tokens per rank, top-{model.top_k}\n")
    print(markdown_table(["EP", "dispatch us", "combine us", "dispatch GB/s", "combine GB/s"], rows))
    return 0


# ---------------------------------------------------------------- allocation

def allocation_sweep(sizes, means, total=8192, jobs=20000, window=1, seed=0, contiguous=True,
                     quiet=False) -> dict[int, list[tuple[float, float]]]:
    """Allocation rate for every (supernode size, mean block size): size -> [(mean, rate)]."""
    from matrixinfer.sim.allocation import simulate_allocation

    rates: dict[int, list] = {s: [] for s in sizes}
    for s, m in tqdm([(s, m) for s in sizes for m in means], desc="allocation", disable=quiet):
        r = simulate_allocation(s, m, total_devices=total, jobs=jobs, window=window, seed=seed, contiguous=contiguous)
        rates[s].append((m, r.allocation_rate))
    return rates


def cmd_allocation(args) -> int:
    from matrixinfer.sim.allocation import clos_cost

    rates = allocation_sweep(args.sizes, args.means, args.total, args.jobs, args.window, args.seed,
                             not args.relaxed, quiet=args.json)
    clos = [clos_cost(s * args.dies_per_npu, l2_radix=args.radix) for s in args.sizes]
    if args.plot:
        from matrixinfer.sim.plots import plot_allocation

        plot_allocation(rates, args.plot)
    if args.json:
        print(json.dumps({"allocation_rate": {str(s): dict(v) for s, v in rates.items()},
                          "clos": [asdict(c) for c in clos]}, indent=2))
        return 0
    print(markdown_table(["S \\ mean block"] + [f"{m:g}" for m in args.means],
                         [[s] + [f"{100 * r:.1f} %" for _, r in rates[s]] for s in args.sizes]))
    print(f"\nUB network as a two-tier Clos ({args.dies_per_npu} dies per NPU, 7 planes, "
          f"L1 16 down + 16 up, L2 radix {args.radix}):\n")
    print(markdown_table(["dies", "two-tier", "L1 chips", "L2 chips", "switch chips/die", "port use",
                          "L2 radix needed"],
                         [[c.devices, c.feasible, c.l1_switches, c.l2_switches, c.switches_per_device,
                           f"{100 * c.port_utilisation:.1f} %", c.min_l2_radix] for c in clos]))
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


# ---------------------------------------------------------------- calibrate / paper tables

def cmd_calibrate(args) -> int:
    """Fit the collective costs to the measured dispatch/combine pair, then the overlap
    efficiency to the decode point with those costs (the overlap depends on them, not
    the other way round)."""
    from matrixinfer.sim.calibration import fit_collectives, fit_overlap
    from matrixinfer.sim.hardware import CollectiveSpec

    hw, model = _specs(args)
    out = {}
    if hw.collective_calibration is not None:
        cf = fit_collectives(hw, model)
        hw = replace(hw, collective=CollectiveSpec(cf.launch_us, cf.handshake_us, hw.collective.metadata_rounds))
        out["collective"] = asdict(cf) | {"in_hardware_file": asdict(_specs(args)[0].collective)}
    f = fit_overlap(hw, model)
    out |= {"overlap": f.overlap, "clipped": f.clipped, "tpot_ms": f.result.tpot_ms,
            "tokens_per_s_per_npu": f.result.tokens_per_s_per_device, "target_tpot_ms": f.target_tpot_ms,
            "target_tokens_per_s_per_npu": f.target_tokens_per_s, "in_hardware_file": _specs(args)[0].efficiency.overlap}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if "collective" in out:
        c = out["collective"]
        print(f"collective: launch {c['launch_us']:.2f} us, handshake {c['handshake_us']:.2f} us "
              f"(hardware file: {c['in_hardware_file']}); dispatch {c['dispatch_us']:.1f} us = "
              + " + ".join(f"{k} {v:.1f}" for k, v in c["dispatch_terms_us"].items())
              + f"; combine {c['combine_us']:.1f} us = "
              + " + ".join(f"{k} {v:.1f}" for k, v in c["combine_terms_us"].items()))
    print(f"fitted overlap efficiency {f.overlap:.4f} (hardware file has {out['in_hardware_file']:.4f}): "
          f"TPOT {f.result.tpot_ms:.2f} ms vs {f.target_tpot_ms} measured, "
          f"{f.result.tokens_per_s_per_device:.0f} tokens/s per NPU vs {f.target_tokens_per_s:.0f}")
    return 0


def cmd_paper_tables(args) -> int:
    from matrixinfer.sim.scenarios import SCENARIOS, paper_tables

    with tqdm(total=len(SCENARIOS), desc="scenarios", disable=args.json) as bar:
        tables = paper_tables(progress=lambda _: bar.update())
    if args.json:
        print(json.dumps(tables))
        return 0
    rows = [[sid, metric, value] for sid, metrics in tables["scenarios"].items() for metric, value in metrics.items()]
    print(markdown_table(["scenario", "metric", "predicted"], rows))
    if args.plots:
        from matrixinfer.sim.plots import plot_allocation

        _decode_plot(DECODE_PLOT)
        plot_allocation(allocation_sweep(ALLOC_SIZES, ALLOC_MEANS, jobs=60000), ALLOC_PLOT)
        print(f"\nplots: {DECODE_PLOT}, {ALLOC_PLOT}")
    return 0


VALIDATE_NOTES = """What the model knows of this machine comes from `matrixinfer bench ops` (GEMM, attention,
bandwidth, collectives) plus three engine fits: the host cost of a decode step (a line over
batch 1, 4, 8 with 16-token prompts) and one prefill factor (the eager engine's prefill at 1 x
256 tokens over its rooflines: per-sequence attention loops and padded expert groups). Every
row here is a prediction at a shape none of them was fitted to. What is left: decode steps come
out low as batch x context grows (up to about 20 % at 16 x 512: the absorbed attention's gather
and softmax are costed as one read of the latents), and TTFT at 16 x 128 tokens about 16 % low
(the prefill factor is fitted at one shape; it is not constant in the batch). Noise on this shared 2-core VM moves
single rows by several percent between runs."""


def cmd_validate(args) -> int:
    import torch

    from matrixinfer.bench.report import save_json, write_section
    from matrixinfer.sim.validate import plot, summary, validate

    torch.set_num_threads(args.threads)
    hw, model = _specs(args)
    with tqdm(total=len(args.batches) * len(args.prompt_lens), desc="validate", disable=args.json) as bar:
        rows = validate(hw, model, args.model, args.dtype, args.batches, args.prompt_lens, args.max_tokens,
                        progress=bar.update)
    out = summary(rows) | {"hardware": hw.name, "model": model.name, "dtype": args.dtype, "threads": args.threads}
    table = markdown_table(
        ["batch", "prompt", "step ms meas", "step ms pred", "TTFT ms meas", "TTFT ms pred", "tok/s meas",
         "tok/s pred", "max err"],
        [[r.batch, r.prompt_len, r.measured_decode_step_ms, r.predicted_decode_step_ms, r.measured_ttft_ms,
          r.predicted_ttft_ms, r.measured_tokens_per_s, r.predicted_tokens_per_s,
          f"{100 * max(r.rel_errors().values()):.1f} %"] for r in rows])
    if args.save:
        from matrixinfer.bench.report import bench_dir, configure

        configure(save=True)  # the tracked results in benchmarks/
        save_json("sim-validate", out)
        plot(rows, bench_dir() / "sim-validate.png")
        within = sum(max(r.rel_errors().values()) <= 0.15 for r in rows)
        write_section("sim-validate", "## Simulator validation on this machine (`matrixinfer simulate validate`)\n\n"
                      f"Real engine ({args.dtype}, {args.threads} thread(s), {args.max_tokens} output tokens) against "
                      f"the cost model with `{args.hardware}`; max relative error "
                      f"{100 * out['max_rel_error']:.1f} %; {within} of {len(rows)} rows within the 15 % goal."
                      f"\n\n{table}\n\n![validation](sim-validate.png)\n\n{VALIDATE_NOTES}")
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"engine vs model on {hw.name}, {model.name}, {args.dtype}\n")
    print(table)
    print(f"\nmax relative error {100 * out['max_rel_error']:.1f} %")
    return 0


def cmd_deployment(args) -> int:
    from matrixinfer.deployment import load_deployment
    from matrixinfer.sim.deploy import predict, serve
    from matrixinfer.sim.hardware import load_hardware
    from matrixinfer.sim.modelspec import load_model

    dep = load_deployment(args.file)
    hw, model = load_hardware(args.hardware), load_model(dep.model)
    out = predict(dep, hw, model, args.batch, args.kv, args.prompt, args.prefill_tokens, args.accept)
    if args.rate and out["decode"]["fits"] and out["prefill"]["fits"]:
        out["serve"] = serve(dep, hw, model, args.rate, args.requests, int(args.prompt), args.output,
                             int(args.batch), args.accept)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.file} on {hw.name}: {dep.devices} devices, {model.name}, {dep.dtype}\n")
    rows = []
    for r in ("prefill", "decode"):
        o = out[r]
        c = o["capacity_gb"]
        rows.append([r, f"{c['weights_gb']:.1f} + {c['kv_gb']:.1f} + {c['buffers_gb']:.1f} = {c['used']:.1f} / "
                     f"{c['hbm_gb']:g}", "yes" if o["fits"] else "NO",
                     o.get("tpot_ms", o.get("ttft_s", float("nan")) * 1e3) if o["fits"] else "-",
                     o.get("tokens_per_s_per_device", "-")])
    print(markdown_table(["role", "HBM GB per device (weights + KV + buffers)", "fits", "TPOT / TTFT ms",
                          "tokens/s per device"], rows))
    for r in ("prefill", "decode"):
        if "error" in out[r]:
            print(f"\n{out[r]['error']}: not simulated")
    if "serve" in out:
        print("\n" + markdown_table(list(out["serve"]), [list(out["serve"].values())]))
    return 0


def cmd_sensitivity(args) -> int:
    from matrixinfer.sim.sensitivity import sensitivity

    rows = sensitivity(args.hardware, args.model, args.step)
    if args.json:
        print(json.dumps({"step": args.step, "rows": rows}))
        return 0
    keys = [k[: -len("_minus")] for k in rows[0] if k.endswith("_minus")]
    print(f"relative change of each metric when one constant moves by -/+{100 * args.step:g} % (nothing refitted)\n")
    print(markdown_table(["constant", "value", "source"] + keys,
                         [[r["constant"], r["value"], r["source"].split(":")[0]]
                          + [f"{100 * r[k + '_minus']:+.1f} / {100 * r[k + '_plus']:+.1f} %" for k in keys] for r in rows]))
    return 0


def cmd_bench_ops(args) -> int:
    from matrixinfer.bench.ops_bench import cmd_bench_ops as run  # torch is imported only here

    return run(args)


def register(sub, bench_sub) -> None:
    from matrixinfer.sim.fault_study import TPOT_SLO_MS, TTFT_SLO_S
    from matrixinfer.sim.faults import DETECT_S, EMS_RECOVER_S, NPU_MTBF_H

    p = bench_sub.add_parser("ops", help="measure operator costs here; write a simulator hardware YAML")
    p.add_argument("--model", default="models/matrixinfer-tiny-moe", help="model dir whose MLA shapes are timed")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="engine dtype for host overhead")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    p.add_argument("--yaml", default=None, help="hardware YAML to write (default: ops.yaml in the results directory, "
                   "benchmarks/ops.yaml with --save)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine host-overhead measurement")
    p.add_argument("--no-collectives", action="store_true", help="skip the 2-process gloo measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_ops)

    sim = sub.add_parser("simulate", help="CloudMatrix384 / GPU-cluster simulator")
    ssub = sim.add_subparsers(dest="simulate_command", required=True)

    p = ssub.add_parser("decode", help="decode step time, TPOT and throughput per device")
    _common(p)
    p.add_argument("--batch", type=float, default=96, help="sequences per device")
    p.add_argument("--sweep", type=float, nargs="*", help="several batch sizes instead of --batch")
    p.add_argument("--kv", type=float, default=4096, help="KV length per sequence")
    p.add_argument("--ep", type=int, default=320)
    p.add_argument("--precision", default="int8", help="weights/GEMMs: int8, fp8, bf16")
    p.add_argument("--dispatch-precision", default=None, help="dispatch tokens (default: --precision)")
    p.add_argument("--mtp", type=int, default=1, help="MTP draft tokens (0 = off)")
    p.add_argument("--accept", type=float, default=0.7, help="MTP acceptance rate per draft")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--shared-devices", type=int, default=None,
                   help="devices with shared-expert replicas (0 = local; default: a tenth of EP if room)")
    p.add_argument("--imbalance", type=float, default=1.0, help="busiest expert device / mean")
    p.add_argument("--expert-skew", type=float, default=0.0,
                   help="Zipf skew of expert popularity; EPLB places the redundant slots (overrides --imbalance)")
    p.add_argument("--no-pipelined-mtp", action="store_true", help="add a host sync per MTP graph launch")
    p.add_argument("--plot", help=f"write the throughput-vs-TPOT figure (e.g. {DECODE_PLOT})")
    p.set_defaults(func=cmd_decode)

    p = ssub.add_parser("prefill", help="prefill batch time and throughput; SP-TP-SP vs DP; context cache")
    _common(p)
    p.add_argument("--tokens", type=float, default=16384, help="prompt tokens per device per batch")
    p.add_argument("--prompt", type=float, default=4096)
    p.add_argument("--devices", type=int, default=32)
    p.add_argument("--ep", type=int, default=32)
    p.add_argument("--attention", choices=["sp-tp-sp", "dp"], default="sp-tp-sp")
    p.add_argument("--precision", default="int8")
    p.add_argument("--cache-hit", type=float, default=0.0, help="fraction of prompt tokens in EMS")
    p.add_argument("--page-plane", choices=["ub", "vpc"], default="ub")
    p.add_argument("--compare-dp", action="store_true", help="DP vs SP-TP-SP on lognormal prompt lengths")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of prompt lengths")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_prefill)

    p = ssub.add_parser("serve", help="discrete-event simulation of the PDC system")
    _common(p)
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--trace", help="CSV arrival,prompt_len,output_len[,prefix_id,prefix_len]")
    p.add_argument("--prefixes", type=int, default=0, help="distinct shared prefixes (0 = none)")
    p.add_argument("--prefix-len", type=int, default=0)
    p.add_argument("--ems-capacity", type=int, default=0, help="context-cache capacity in tokens (0 = off)")
    p.add_argument("--prefill-instances", type=int, default=6)
    p.add_argument("--prefill-devices", type=int, default=32)
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument("--decode-devices", type=int, default=320)
    p.add_argument("--max-batch", type=int, default=96, help="sequences per decode device")
    p.add_argument("--mtp", type=int, default=1)
    p.add_argument("--accept", type=float, default=0.7)
    p.add_argument("--sample-dt", type=float, default=1.0)
    p.add_argument("--chunk-tokens", type=int, default=0, help="chunked prefill: tokens per prefill step "
                   "of an instance (0 = whole prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write utilisation over time to this PNG")
    p.set_defaults(func=cmd_serve)

    p = ssub.add_parser("faults", help="the PDC simulation under NPU / link / node / EMS-server faults; "
                        "one big decode instance vs several smaller ones")
    p.add_argument("--hardware", nargs="+", default=["cloudmatrix384"], help="bundled names or YAML paths")
    p.add_argument("--model", default="deepseek-r1")
    p.add_argument("--json", action="store_true")
    p.add_argument("--layouts", nargs="+", default=["1x320", "5x64", "10x32"], help="decode INSTANCESxDEVICES")
    p.add_argument("--prefill", default="6x32", help="prefill INSTANCESxDEVICES")
    p.add_argument("--rate", type=float, default=900.0)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--output", type=int, default=1024)
    p.add_argument("--prefixes", type=int, default=200)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--ems-capacity", type=int, default=1_000_000, help="context-cache tokens (0 = off)")
    p.add_argument("--ems-servers", type=int, default=48, help="EMS MP servers (one per CloudMatrix node)")
    p.add_argument("--max-batch", type=int, default=96)
    p.add_argument("--mtp", type=int, default=1)
    p.add_argument("--accept", type=float, default=0.7)
    p.add_argument("--horizon", type=float, default=300.0, help="seconds of arrivals (and of faults)")
    p.add_argument("--warmup", type=float, default=60.0, help="start of the measured window, seconds")
    p.add_argument("--sample-dt", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--npu-mtbf-h", type=float, default=NPU_MTBF_H, help="per NPU package, hours (0 = none)")
    p.add_argument("--link-mtbf-h", type=float, default=0.0, help="per device link, hours (0 = none)")
    p.add_argument("--node-mtbf-h", type=float, default=0.0, help="per server node, hours (0 = none)")
    p.add_argument("--ems-mtbf-h", type=float, default=0.0, help="per EMS MP server, hours (0 = none)")
    p.add_argument("--detect-s", type=float, default=DETECT_S, help="fault to detection, instances")
    p.add_argument("--recover-s", type=float, default=None,
                   help="detection to rebuilt, instances (default: measured restart + weight reload from EMS)")
    p.add_argument("--ems-detect-s", type=float, default=DETECT_S, help="EMS heartbeat timeout")
    p.add_argument("--ems-recover-s", type=float, default=EMS_RECOVER_S)
    p.add_argument("--event", action="append", help="explicit fault T:KIND:INDEX (kind npu|link|node|ems), repeatable")
    p.add_argument("--faults", help="YAML fault schedule (overrides the flags it sets; see sim/faults.py)")
    p.add_argument("--ttft-slo-s", type=float, default=TTFT_SLO_S)
    p.add_argument("--tpot-slo-ms", type=float, default=TPOT_SLO_MS)
    p.add_argument("--plot", help=f"write the goodput time series (e.g. {FAULTS_PLOT})")
    p.set_defaults(func=cmd_faults)

    p = ssub.add_parser("dispatch", help="MoE dispatch/combine latency against EP size")
    _common(p)
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--precision", default="int8", help="dispatch precision (combine is bf16)")
    p.set_defaults(func=cmd_dispatch)

    p = ssub.add_parser("allocation", help="NPU allocation rate vs mean block size; Clos cost")
    p.add_argument("--sizes", type=int, nargs="+", default=ALLOC_SIZES)
    p.add_argument("--means", type=float, nargs="+", default=ALLOC_MEANS)
    p.add_argument("--total", type=int, default=8192, help="devices in the whole cluster")
    p.add_argument("--jobs", type=int, default=20000, help="job completions simulated per point")
    p.add_argument("--window", type=int, default=1, help="waiting jobs the scheduler may pick from (1 = FIFO)")
    p.add_argument("--relaxed", action="store_true", help="any free devices of a supernode make a block "
                   "(default: contiguous devices, the paper's definition)")
    p.add_argument("--radix", type=int, default=48, help="L2 switch radix")
    p.add_argument("--dies-per-npu", type=int, default=2, help="UB endpoints per NPU for the Clos cost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help=f"write the figure (e.g. {ALLOC_PLOT})")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_allocation)

    p = ssub.add_parser("calibrate", help="fit the overlap efficiency to the measured decode point")
    _common(p)
    p.set_defaults(func=cmd_calibrate)

    p = ssub.add_parser("deployment", help="predict a deployment file (the one `serve --deployment` reads)")
    p.add_argument("file", help="deployment YAML (see matrixinfer/deployment.py)")
    p.add_argument("--hardware", default="cloudmatrix384", help="bundled name or a YAML path")
    p.add_argument("--batch", type=float, default=96, help="decode sequences per device")
    p.add_argument("--kv", type=float, default=4096, help="decode KV length")
    p.add_argument("--prompt", type=float, default=4096, help="prompt length for prefill")
    p.add_argument("--prefill-tokens", type=float, default=16384, help="prefill batch tokens per device")
    p.add_argument("--accept", type=float, default=0.7, help="MTP acceptance per draft")
    p.add_argument("--rate", type=float, default=0.0, help="also run the DES at this request rate (0 = off)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_deployment)

    p = ssub.add_parser("sensitivity", help="change of the headline predictions per non-hardware-fact constant")
    _common(p)
    p.add_argument("--step", type=float, default=0.10, help="relative move of each constant")
    p.set_defaults(func=cmd_sensitivity)

    p = ssub.add_parser("validate", help="real engine on this machine vs the model's prediction")
    p.add_argument("--hardware", default="benchmarks/ops.yaml", help="hardware YAML (from `matrixinfer bench ops`)")
    p.add_argument("--model", default="models/matrixinfer-tiny-moe", help="model directory the engine loads")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads (as in bench ops)")
    p.add_argument("--batches", type=int, nargs="+", default=[2, 4, 16])
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--max-tokens", type=int, default=17)
    p.add_argument("--save", action="store_true", help="write benchmarks/sim-validate.{json,png} and its section")
    p.add_argument("--json", action="store_true", help="print one JSON object with rows and max_rel_error")
    p.set_defaults(func=cmd_validate)

    p = ssub.add_parser("paper-tables", help="predictions for the paper's scenarios")
    p.add_argument("--json", action="store_true", help='print {"scenarios": {id: {metric: value}}}')
    p.add_argument("--plots", action="store_true", help=f"also write {DECODE_PLOT} and {ALLOC_PLOT}")
    p.set_defaults(func=cmd_paper_tables)
