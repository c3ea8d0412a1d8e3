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


# ---------------------------------------------------------------- fused dispatch / combine

@dataclass(frozen=True)
class CollectiveFit:
    launch_us: float
    handshake_us: float
    dispatch_us: float  # predicted with the fitted values (equals the measurement)
    combine_us: float
    dispatch_terms_us: dict
    combine_terms_us: dict


def fit_collectives(hw: HardwareSpec, model: ModelSpec) -> CollectiveFit:
    """Launch and handshake costs that make the modelled dispatch and combine equal the
    measured pair (hardware file's `collective_calibration`).

    Every other term is predicted (payload over the plane, quantize / reorder / reduce passes
    over HBM, flag writes per peer), and the two fitted costs enter linearly:
        dispatch = launch + (1 + m) handshake + K_dispatch   (m metadata rounds + data round)
        combine  = launch +   handshake + K_combine    (data round only)
    so the fit is an exact solve of two equations. A negative solution means the predicted
    terms alone already exceed a measurement; that is reported as an error, not clipped.
    """
    from matrixinfer.sim.costs import ep_comm
    from matrixinfer.sim.hardware import CollectiveSpec

    c = hw.collective_calibration
    if c is None:
        raise SpecError(f"{hw.name}: no collective_calibration in its hardware file")

    def comm(spec: HardwareSpec):
        return ep_comm(spec, model, c.tokens, c.ep, c.dispatch_precision, c.combine_precision,
                       plane=spec.ep_decode_plane, dedup_ranks=False)

    if hw.collective.metadata_rounds <= 0:
        raise SpecError(f"{hw.name}: fitting needs a metadata round (collective.metadata_rounds > 0)")
    base = comm(replace(hw, collective=CollectiveSpec(metadata_rounds=hw.collective.metadata_rounds)))
    k_d, k_c = base.dispatch_s * 1e6, base.combine_s * 1e6
    handshake = ((c.dispatch_us - c.combine_us) - (k_d - k_c)) / hw.collective.metadata_rounds
    launch = c.combine_us - handshake - k_c
    if handshake < 0 or launch < 0:
        raise SpecError(f"{hw.name}: predicted terms exceed the measured dispatch/combine "
                        f"(launch {launch:.1f} us, handshake {handshake:.1f} us)")
    fitted = comm(replace(hw, collective=CollectiveSpec(launch, handshake, hw.collective.metadata_rounds)))
    return CollectiveFit(launch, handshake, fitted.dispatch_s * 1e6, fitted.combine_s * 1e6,
                         {k: v * 1e6 for k, v in fitted.dispatch_terms.items()},
                         {k: v * 1e6 for k, v in fitted.combine_terms.items()})
