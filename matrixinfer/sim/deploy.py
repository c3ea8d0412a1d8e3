"""Predict a `matrixinfer.deployment.Deployment` (the file `serve --deployment` reads) on any
hardware: HBM capacity per role, decode step / TPOT / throughput, prefill batch / TTFT /
throughput, and optionally the PDC system under Poisson load (the discrete-event simulation).

Mapping from the deployment to the cost model:
  weights      dtype int8 -> INT8 GEMMs, bfloat16 -> BF16, float32 -> FP32
  decode       EP = decode.expert_parallel_size over max(tp, ep) devices, DP attention,
               MTP drafts = speculative_num_tokens, dispatch precision = dispatch_dtype
  prefill      prefill_parallel dp | tp | sp-tp-sp over the instance's devices, EP over them
  colocated    the decode role's instances also prefill: both predictions are per device of
               that instance, and the DES is not run (it models disaggregated roles)
"""

from __future__ import annotations

from dataclasses import asdict

from matrixinfer.deployment import Deployment
from matrixinfer.sim.capacity import hbm_check
from matrixinfer.sim.decode import DecodeConfig, decode_step
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec
from matrixinfer.sim.prefill import PrefillConfig, prefill_batch

WEIGHT_PRECISION = {"int8": "int8", "bfloat16": "bf16", "float32": "fp32"}


def _decode_cfg(dep: Deployment, batch: float, kv: float, acceptance: float) -> DecodeConfig:
    d = dep.decode
    return DecodeConfig(batch_per_device=batch, kv_len=kv, ep=d.devices, weight_precision=WEIGHT_PRECISION[dep.dtype],
                        dispatch_precision=d.dispatch_dtype, mtp_drafts=d.speculative_num_tokens,
                        mtp_acceptance=acceptance, microbatches=2 if d.expert_parallel_size > 1 else 1)


def _prefill_cfg(dep: Deployment, tokens: float, prompt: float, hw: HardwareSpec) -> PrefillConfig:
    role = dep.prefill or dep.decode
    par = getattr(role, "prefill_parallel", "dp")
    return PrefillConfig(tokens_per_device=tokens, prompt_len=prompt, devices=role.devices, ep=role.devices,
                         attention=par, weight_precision=WEIGHT_PRECISION[dep.dtype],
                         dispatch_precision=getattr(role, "dispatch_dtype", "int8") if dep.dtype == "int8" else "bf16",
                         microbatches=2 if role.expert_parallel_size > 1 else 1,
                         hierarchical_ep=hw.scale_up.domain and role.devices > hw.scale_up.domain)


def predict(dep: Deployment, hw: HardwareSpec, model: ModelSpec, batch: float, kv: float, prompt: float,
            prefill_tokens: float, acceptance: float = 0.7) -> dict:
    """Per-role predictions; a role that does not fit in HBM is reported with `fits: false`
    and no timing."""
    wp = WEIGHT_PRECISION[dep.dtype]
    if dep.devices > hw.devices:
        raise ValueError(f"the deployment needs {dep.devices} devices; {hw.name} has {hw.devices}")
    out = {"hardware": hw.name, "model": model.name, "devices": dep.devices, "deployment": asdict(dep)}
    d = dep.decode
    cap = hbm_check(hw, model, batch, kv, batch * (1 + d.speculative_num_tokens), wp, "bf16", d.dispatch_dtype,
                    d.tensor_parallel_size, d.expert_parallel_size)
    out["decode"] = _role("decode", cap, lambda: decode_step(hw, model, _decode_cfg(dep, batch, kv, acceptance)),
                          ("step_ms", "tpot_ms", "tokens_per_s_per_device"))
    p = dep.prefill or dep.decode
    cap = hbm_check(hw, model, prefill_tokens / prompt, prompt, prefill_tokens, wp, "bf16", "int8",
                    p.tensor_parallel_size, p.expert_parallel_size)
    out["prefill"] = _role("prefill", cap, lambda: prefill_batch(hw, model, _prefill_cfg(dep, prefill_tokens, prompt, hw)),
                           ("batch_s", "ttft_s", "tokens_per_s_per_device"))
    return out


def _role(name: str, cap, predict_role, keys: tuple[str, ...]) -> dict:
    """One role's capacity check and, when it fits, its predicted timings."""
    role = {"capacity_gb": asdict(cap) | {"used": cap.used_gb}, "fits": cap.fits}
    if not cap.fits:
        return role | {"error": cap.message(name)}
    r = predict_role()
    return role | {k: getattr(r, k) for k in keys}


def serve(dep: Deployment, hw: HardwareSpec, model: ModelSpec, rate: float, requests: int, prompt: int,
          output: int, max_batch: int, acceptance: float = 0.7, seed: int = 0) -> dict:
    """The disaggregated deployment under Poisson load (SimPy, serving.py)."""
    from matrixinfer.sim.serving import CostModelTimes, ServingConfig, poisson_requests, simulate

    if dep.prefill is None:
        raise ValueError("the serving simulation models disaggregated prefill and decode; this deployment is colocated")
    cfg = ServingConfig(prefill_instances=dep.prefill.instances, decode_instances=dep.decode.instances,
                        prefill_devices=dep.prefill.devices, decode_devices=dep.decode.devices,
                        max_batch_per_device=max_batch, mtp_drafts=dep.decode.speculative_num_tokens,
                        mtp_acceptance=acceptance, seed=seed)
    wp = WEIGHT_PRECISION[dep.dtype]
    times = CostModelTimes(hw, model, cfg,
                           prefill_overrides={"attention": dep.prefill.prefill_parallel, "weight_precision": wp},
                           decode_overrides={"weight_precision": wp, "dispatch_precision": dep.decode.dispatch_dtype})
    res = simulate(poisson_requests(rate, requests, prompt, output, seed=seed), cfg, times.prefill_time,
                   times.decode_time, times.kv_bytes_per_token())
    return res.summary()
