"""Sensitivity of the headline predictions to every constant that is not a hardware fact.

Each constant of a hardware YAML whose source is not "hardware fact" (measured efficiencies,
assumptions, fitted values) is moved by -10 % and +10 % (fractions capped at 1) with every
other constant held, nothing refitted, and the change of each metric is reported. The
measurement targets themselves (calibration.*, collective_calibration.*) are skipped: they
only feed the fits.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from matrixinfer.sim import costs
from matrixinfer.sim.decode import DecodeConfig, decode_step
from matrixinfer.sim.hardware import HARDWARE_DIR, HardwareSpec, hardware_from_dict, load_hardware
from matrixinfer.sim.modelspec import ModelSpec, load_model
from matrixinfer.sim.prefill import PrefillConfig, prefill_batch

FRACTIONS = ("efficiency.",)
SKIP = ("calibration.", "collective_calibration.")


def metrics(hw: HardwareSpec, model: ModelSpec) -> dict:
    """The calibration decode point, the paper's prefill point and the EP8 dispatch/combine."""
    d = decode_step(hw, model, DecodeConfig(96, 4096, ep=320))
    c = costs.ep_comm(hw, model, 128, 8, "int8", "bf16", plane=hw.ep_decode_plane, dedup_ranks=False)
    return {"decode_tpot_ms": d.tpot_ms,
            "prefill_tokens_per_s": prefill_batch(hw, model, PrefillConfig()).tokens_per_s_per_device,
            "dispatch_ep8_us": c.dispatch_s * 1e6, "combine_ep8_us": c.combine_s * 1e6}


def _set(raw: dict, dotted: str, value: float) -> None:
    *path, last = dotted.split(".")
    for k in path:
        raw = raw[k]
    raw[last] = value


def _get(raw: dict, dotted: str) -> float:
    for k in dotted.split("."):
        raw = raw[k]
    return raw


def sensitivity(hardware: str = "cloudmatrix384", model: str = "deepseek-r1", step: float = 0.10) -> list[dict]:
    """One row per non-hardware-fact constant: its source, value, and each metric's relative
    change at -step and +step."""
    hw = load_hardware(hardware)
    m = load_model(model)
    p = Path(hardware) if Path(hardware).suffix else HARDWARE_DIR / f"{hardware}.yaml"
    raw = yaml.safe_load(p.read_text())
    base = metrics(hw, m)
    rows = []
    for key, src in hw.sources.items():
        if src.startswith("hardware fact") or key.startswith(SKIP):
            continue
        v = _get(raw, key)
        row = {"constant": key, "value": v, "source": src}
        for sign in (-1, 1):
            new = v * (1 + sign * step)
            if key.startswith(FRACTIONS):
                new = min(1.0, new)
            r = copy.deepcopy(raw)
            _set(r, key, new)
            got = metrics(hardware_from_dict(r, p.name), m)
            for k, b in base.items():
                row[f"{k}_{'minus' if sign < 0 else 'plus'}"] = got[k] / b - 1
        rows.append(row)
    return rows
