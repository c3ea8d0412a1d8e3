"""What failures cost a PDC deployment (`matrixinfer simulate faults`): the serving simulation
with and without a fault schedule, for several decode layouts of the same devices (one EP320
instance against several smaller ones) under the same load and the same faults.

Metrics per run, over the window [warmup, horizon] of the arrivals:
  goodput             output tokens delivered per second (first tokens included)
  SLO attainment      fraction of requests arriving in the window with TTFT <= ttft_slo_s
                      and TPOT <= tpot_slo_ms (both, and each)
  tokens recomputed   context of requests lost with a decode instance + prefill work lost
                      with a prefill instance + prefix tokens missed on a failed EMS server
  instance-s down     sum over instances of the time from fault to rebuilt
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from matrixinfer.sim.faults import FaultInjector, FaultSchedule, Layout, instance_recover_s, random_events
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec
from matrixinfer.sim.scenarios import H800_DECODE, H800_PREFILL
from matrixinfer.sim.serving import CostModelTimes, ServingConfig, ServingResult, poisson_requests, simulate

TTFT_SLO_S = 2.0  # assumption: a common interactive TTFT target (the paper states none)
TPOT_SLO_MS = 50.0  # the paper's decode SLO (TPOT < 50 ms)


@dataclass(frozen=True)
class Load:
    rate: float = 900.0  # requests per second, Poisson
    prompt: int = 2048
    output: int = 1024
    prefixes: int = 200  # shared prefixes (the context cache's hits)
    prefix_len: int = 1024
    seed: int = 0


@dataclass(frozen=True)
class Study:
    load: Load = Load()
    warmup_s: float = 60.0  # the decode batch fills over about one output's lifetime
    ttft_slo_s: float = TTFT_SLO_S
    tpot_slo_ms: float = TPOT_SLO_MS


def parse_layout(text: str) -> tuple[int, int]:
    """'5x64' -> (5 instances, 64 devices each)."""
    try:
        n, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r}: expected INSTANCESxDEVICES, e.g. 5x64") from None
    if n < 1 or d < 1:
        raise ValueError(f"layout {text!r}: both numbers must be >= 1")
    return n, d


def cost_model(hw: HardwareSpec, model: ModelSpec, cfg: ServingConfig) -> CostModelTimes:
    """The serving step times; GPU clusters run FP8 with DeepEP-style EP as in the paper tables."""
    if "fp8" in hw.device.tflops:
        return CostModelTimes(hw, model, cfg, prefill_overrides=dict(H800_PREFILL),
                              decode_overrides={k: v for k, v in H800_DECODE.items() if k != "ep"})
    return CostModelTimes(hw, model, cfg)


def recover_defaults(hw: HardwareSpec, model: ModelSpec, cfg: ServingConfig, ems_recover_s: float) -> dict:
    wp = "fp8" if "fp8" in hw.device.tflops else "int8"
    return {"prefill": instance_recover_s(hw, model, cfg.prefill_devices, wp),
            "decode": instance_recover_s(hw, model, cfg.decode_devices, wp), "ems": ems_recover_s}


def window_goodput(res: ServingResult, t0: float, t1: float) -> float:
    """Output tokens delivered per second between the samples nearest t0 and t1."""
    pts = [(s["t"], s["output_tokens"]) for s in res.utilisation if t0 <= s["t"] <= t1]
    if len(pts) < 2:
        return 0.0
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def slo_attainment(res: ServingResult, t0: float, t1: float, ttft_s: float, tpot_ms: float) -> dict:
    reqs = [r for r in res.requests if t0 <= r.arrival <= t1]
    if not reqs:
        return {"ttft": float("nan"), "tpot": float("nan"), "both": float("nan")}
    ok_ttft = [r.first_token is not None and r.ttft <= ttft_s for r in reqs]
    ok_tpot = [r.done is not None and (r.tpot is None or r.tpot * 1e3 <= tpot_ms) for r in reqs]
    n = len(reqs)
    return {"ttft": sum(ok_ttft) / n, "tpot": sum(ok_tpot) / n,
            "both": sum(a and b for a, b in zip(ok_ttft, ok_tpot)) / n}


def run(hw: HardwareSpec, model: ModelSpec, cfg: ServingConfig, schedule: FaultSchedule | None, study: Study,
        horizon_s: float, ems_recover_s: float, progress: Callable[[int], None] | None = None) -> dict:
    """One serving run (no faults when `schedule` is None) and its metrics."""
    ld = study.load
    reqs = poisson_requests(ld.rate, max(1, round(ld.rate * horizon_s)), ld.prompt, ld.output, seed=ld.seed,
                            prefixes=ld.prefixes, prefix_len=ld.prefix_len)
    times = cost_model(hw, model, cfg)
    injector = None
    if schedule is not None:
        layout = Layout.of(hw, cfg)
        injector = FaultInjector(random_events(layout, replace(schedule, horizon_s=horizon_s)), layout, schedule,
                                 recover_defaults(hw, model, cfg, ems_recover_s))
    res = simulate(reqs, cfg, times.prefill_time, times.decode_time, times.kv_bytes_per_token(), progress=progress,
                   faults=injector, horizon_s=horizon_s)
    t0, t1 = study.warmup_s, horizon_s
    out = {"goodput_tok_s": window_goodput(res, t0, t1),
           "slo": slo_attainment(res, t0, t1, study.ttft_slo_s, study.tpot_slo_ms),
           "series": res.utilisation, "summary": res.summary()}
    if injector is not None:
        st = injector.stats
        out |= {"faults": st.faults, "absorbed": st.absorbed, "instance_failures": st.instance_failures,
                "instance_s_down": st.down_s, "tokens_recomputed": st.recomputed_tokens,
                "recomputed": {"decode": st.recomputed_decode_tokens, "prefill": st.recomputed_prefill_tokens,
                               "ems": st.ems_miss_tokens},
                "recover_s": injector.recover_default, "log": st.log}
    return out


def compare(hw: HardwareSpec, model: ModelSpec, base: ServingConfig, layouts: list[tuple[int, int]],
            schedule: FaultSchedule, study: Study, ems_recover_s: float,
            progress: Callable[[int], None] | None = None) -> list[dict]:
    """Every decode layout with the fault schedule and without; same load, same prefill pool,
    same fault list (components are numbered over the same devices)."""
    rows = []
    for n, d in layouts:
        cfg = replace(base, decode_instances=n, decode_devices=d)
        free = run(hw, model, cfg, None, study, schedule.horizon_s, ems_recover_s, progress)
        hit = run(hw, model, cfg, schedule, study, schedule.horizon_s, ems_recover_s, progress)
        lost = 1 - hit["goodput_tok_s"] / free["goodput_tok_s"] if free["goodput_tok_s"] else float("nan")
        rows.append({"hardware": hw.name, "layout": f"{n} x EP{d}", "decode_instances": n, "decode_devices": d,
                     "free": free, "faults": hit, "goodput_lost": lost})
    return rows
