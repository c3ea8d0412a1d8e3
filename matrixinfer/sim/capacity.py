"""HBM capacity of one device: weights + KV cache + buffers against the device's memory.

A configuration that does not fit is reported, not simulated (a step time for a batch that
cannot be held would be fiction).

Per device of an instance with tensor-parallel size tp and expert-parallel size ep:
  weights  attention (+ dense FFN layers) / tp, embedding + lm_head / tp (replicated per
           DP rank), the routed experts of the device's slots (ceil(E / slots) per MoE layer)
           plus the shared experts (each device runs them, or one tenth of the group holds them)
  KV       sequences x KV length x layers x cached elements per token x KV bytes / tp
  buffers  dispatch + combine receive buffers (balanced routing, double-buffered) per
           microbatch, plus a runtime reserve
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from matrixinfer.sim.costs import BYTES, token_bytes
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec

RUNTIME_RESERVE_GB = 2.0  # assumption: framework, graphs and workspace per device


@dataclass(frozen=True)
class Capacity:
    weights_gb: float
    kv_gb: float
    buffers_gb: float
    hbm_gb: float

    @property
    def used_gb(self) -> float:
        return self.weights_gb + self.kv_gb + self.buffers_gb

    @property
    def fits(self) -> bool:
        return self.used_gb <= self.hbm_gb

    def message(self, what: str) -> str:
        return (f"{what} does not fit in HBM: weights {self.weights_gb:.1f} + KV {self.kv_gb:.1f} + buffers "
                f"{self.buffers_gb:.1f} = {self.used_gb:.1f} GB > {self.hbm_gb:g} GB per device")


def weight_bytes_per_device(model: ModelSpec, weight_precision: str, tp: int, ep: int) -> float:
    wb = BYTES[weight_precision]
    dense_part = model.layers * model.attention_params() + (model.layers - model.moe_layers) * model.dense_ffn_params()
    emb_head = 2 * model.vocab * model.hidden * BYTES["bf16"]  # kept in BF16, as in the paper's INT8 deployment
    experts = 0.0
    if model.routed_experts:
        per_dev = math.ceil(model.routed_experts / max(1, ep)) + model.shared_experts
        experts = model.moe_layers * (per_dev * model.expert_params() * wb + model.hidden * model.routed_experts * 2)
    return dense_part * wb / tp + emb_head / tp + experts


def hbm_check(hw: HardwareSpec, model: ModelSpec, seqs_per_device: float, kv_len: float, tokens_per_step: float,
              weight_precision: str = "int8", kv_precision: str = "bf16", dispatch_precision: str = "int8",
              tp: int = 1, ep: int = 1, microbatches: int = 2) -> Capacity:
    """`tokens_per_step`: tokens one device sends through the MoE per step (decode: sequences
    x (1 + drafts); prefill: its batch tokens)."""
    weights = weight_bytes_per_device(model, weight_precision, tp, ep)
    kv = seqs_per_device * kv_len * model.layers * model.kv_elems_per_token_layer() * BYTES[kv_precision] / tp
    buffers = RUNTIME_RESERVE_GB * 1e9
    if model.routed_experts and ep > 1:
        per_mb = tokens_per_step / microbatches
        # balanced routing: the device receives as many token copies as it sends (top-k per token),
        # dispatch and combine, each double-buffered
        recv = per_mb * model.top_k * (token_bytes(model.hidden, dispatch_precision) + model.hidden * BYTES["bf16"])
        buffers += microbatches * recv * 2
    return Capacity(weights / 1e9, kv / 1e9, buffers / 1e9, hw.device.hbm_gb)
