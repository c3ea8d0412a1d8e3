"""Fit the one efficiency factor the hardware facts cannot give: microbatch overlap.

Everything else in the decode model comes from the spec sheet and the measured MLA / GEMM
efficiencies. How much of the shorter of the two microbatch paths (attention vs MoE) the
two-stream pipeline hides depends on the scheduler and is not derivable, so it is fitted
by bisection to the single measured decode point (TPOT at 4K KV, batch 96 per die).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from matrixinfer.sim.decode import DecodeConfig, DecodeResult, decode_step
from matrixinfer.sim.hardware import HardwareSpec, SpecError
from matrixinfer.sim.modelspec import ModelSpec


@dataclass(frozen=True)
class Fit:
    overlap: float
    result: DecodeResult
    target_tpot_ms: float
    target_tokens_per_s: float
    clipped: bool  # True if the target lies outside overlap in [0, 1]


def calibration_config(hw: HardwareSpec, **overrides) -> DecodeConfig:
    if hw.calibration is None:
        raise SpecError(f"{hw.name}: no calibration point in its hardware file")
    c = hw.calibration
    return DecodeConfig(batch_per_device=c.batch_per_device, kv_len=c.kv_len, ep=c.ep, **overrides)


def fit_overlap(hw: HardwareSpec, model: ModelSpec, tol_ms: float = 1e-4) -> Fit:
    """Overlap efficiency in [0, 1] whose predicted TPOT equals the measured one.

    TPOT falls monotonically as overlap rises (more of the shorter path is hidden), so
    bisection converges; a target outside the bracket is reported as clipped.
    """
    c = hw.calibration
    cfg = calibration_config(hw)

    def tpot(ov: float) -> float:
        return decode_step(hw, model, replace(cfg, overlap=ov)).tpot_ms

    lo, hi = 0.0, 1.0
    if tpot(hi) > c.tpot_ms or tpot(lo) < c.tpot_ms:
        best = hi if tpot(hi) > c.tpot_ms else lo
        return Fit(best, decode_step(hw, model, replace(cfg, overlap=best)), c.tpot_ms, c.tokens_per_s_per_npu, True)
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if tpot(mid) > c.tpot_ms:
            lo = mid
        else:
            hi = mid
        if abs(tpot(mid) - c.tpot_ms) < tol_ms:
            lo = hi = mid
    ov = (lo + hi) / 2
    return Fit(ov, decode_step(hw, model, replace(cfg, overlap=ov)), c.tpot_ms, c.tokens_per_s_per_npu, False)


def with_overlap(hw: HardwareSpec, overlap: float) -> HardwareSpec:
    return replace(hw, efficiency=replace(hw.efficiency, overlap=overlap))
