"""CloudMatrix384 and GPU-cluster simulator: hardware and model specs as data, a pure
roofline / collective cost model, a SimPy simulation of PDC serving, and an allocation study.

See docs/simulator.md for every cost term and the validation against published numbers.
"""

from matrixinfer.sim.allocation import clos_cost, simulate_allocation
from matrixinfer.sim.decode import DecodeConfig, DecodeResult, decode_step
from matrixinfer.sim.hardware import HardwareSpec, SpecError, load_hardware
from matrixinfer.sim.modelspec import ModelSpec, load_model
from matrixinfer.sim.prefill import PrefillConfig, PrefillResult, prefill_batch
from matrixinfer.sim.scenarios import paper_tables
from matrixinfer.sim.serving import CostModelTimes, Request, ServingConfig, simulate

__all__ = [
    "CostModelTimes", "DecodeConfig", "DecodeResult", "HardwareSpec", "ModelSpec", "PrefillConfig",
    "PrefillResult", "Request", "ServingConfig", "SpecError", "clos_cost", "decode_step", "load_hardware",
    "load_model", "paper_tables", "prefill_batch", "simulate", "simulate_allocation",
]
