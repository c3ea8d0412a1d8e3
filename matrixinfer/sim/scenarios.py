"""The paper's scenarios, predicted by the model (`matrixinfer simulate paper-tables`).

Every number here is computed from the hardware and model files and the cost model; none
is copied from the paper. Comparisons with published numbers live in docs/simulator.md
and tests/sim, as targets with tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from matrixinfer.sim import costs
from matrixinfer.sim.allocation import simulate_allocation
from matrixinfer.sim.caching import context_cache, model_cache
from matrixinfer.sim.decode import DecodeConfig, decode_step
from matrixinfer.sim.hardware import HardwareSpec, load_hardware
from matrixinfer.sim.modelspec import ModelSpec, load_model
from matrixinfer.sim.prefill import PrefillConfig, prefill_batch

MTP = {"mtp_drafts": 1, "mtp_acceptance": 0.7}


def mean_decode_kv(prompt: int, output: int) -> float:
    """Mean KV length over a request's decode: the prompt plus half the output."""
    return prompt + output / 2


def _decode(hw, model, batch, kv, **kw) -> dict:
    r = decode_step(hw, model, DecodeConfig(batch_per_device=batch, kv_len=kv, **MTP, **kw))
    return {"tpot_ms": r.tpot_ms, "tokens_per_s_per_npu": r.tokens_per_s_per_device}


def _prefill(hw, model, **kw) -> dict:
    return {"tokens_per_s_per_npu": prefill_batch(hw, model, PrefillConfig(**kw)).tokens_per_s_per_device}


def _comm(hw, model, ep, which) -> dict:
    c = costs.ep_comm(hw, model, 128, ep, "int8", "bf16", plane=hw.ep_decode_plane, dedup_ranks=False)
    return {"latency_us": 1e6 * (c.dispatch_s if which == "dispatch" else c.combine_s)}


def _context(hw, model, hit) -> dict:
    r = context_cache(hw, model, hit, "ub")
    return {"prefill_throughput_ratio": r.prefill_throughput_ratio, "ttft_reduction": r.ttft_reduction}


def _alloc(size, mean) -> dict:
    r = simulate_allocation(size, mean, contiguous=True, window=1, jobs=40000, seed=0)  # the paper's blocks
    return {"allocation_rate": r.allocation_rate}


@dataclass(frozen=True)
class Scenario:
    id: str
    description: str
    run: Callable[[HardwareSpec, HardwareSpec, ModelSpec], dict]  # (cloudmatrix, h800, model) -> metrics


H800_DECODE = dict(ep=128, weight_precision="fp8", dispatch_precision="fp8", shared_expert_devices=0)
H800_PREFILL = dict(attention="dp", weight_precision="fp8", dispatch_precision="fp8", hierarchical_ep=True)

SCENARIOS: list[Scenario] = [
    Scenario("decode-cm384-4k-b96", "EP320 decode, 4K KV, 96 seqs/die (the calibration point)",
             lambda cm, h8, m: _decode(cm, m, 96, 4096)),
    Scenario("decode-cm384-1k1k-b128", "EP320 decode, 1K prompt / 1K output, 128 seqs/die",
             lambda cm, h8, m: _decode(cm, m, 128, mean_decode_kv(1024, 1024))),
    Scenario("decode-cm384-2k256-b112", "EP320 decode, 2K prompt / 256 output, 112 seqs/die",
             lambda cm, h8, m: _decode(cm, m, 112, mean_decode_kv(2048, 256))),
    Scenario("decode-cm384-4k256-b24", "EP320 decode, 4K prompt / 256 output, 24 seqs/die",
             lambda cm, h8, m: _decode(cm, m, 24, mean_decode_kv(4096, 256))),
    Scenario("decode-cm384-4k256-b8", "EP320 decode, 4K prompt / 256 output, 8 seqs/die",
             lambda cm, h8, m: _decode(cm, m, 8, mean_decode_kv(4096, 256))),
    Scenario("prefill-cm384-4k", "SP-TP-SP prefill over 32 dies, EP32, 4K prompts, 16K tokens/die",
             lambda cm, h8, m: _prefill(cm, m)),
    Scenario("decode-h800-b128", "H800 EP128 decode, 4K KV, 128 seqs/GPU, FP8, DeepEP LL over RDMA",
             lambda cm, h8, m: _decode(h8, m, 128, 4096, **H800_DECODE)),
    Scenario("prefill-h800-4k", "H800 DP-attention prefill, EP32 over 4 nodes, 4K prompts, 16K tokens/GPU",
             lambda cm, h8, m: _prefill(h8, m, **H800_PREFILL)),
    Scenario("dispatch-cm384-ep8", "FusedDispatch, 128 tokens/rank, INT8, EP8",
             lambda cm, h8, m: _comm(cm, m, 8, "dispatch")),
    Scenario("dispatch-cm384-ep256", "FusedDispatch, 128 tokens/rank, INT8, EP256",
             lambda cm, h8, m: _comm(cm, m, 256, "dispatch")),
    Scenario("combine-cm384-ep8", "FusedCombine, 128 tokens/rank, BF16, EP8",
             lambda cm, h8, m: _comm(cm, m, 8, "combine")),
    Scenario("combine-cm384-ep256", "FusedCombine, 128 tokens/rank, BF16, EP256",
             lambda cm, h8, m: _comm(cm, m, 256, "combine")),
    Scenario("context-cache-cm384-50", "prefill with 50 % of prompt tokens in EMS (UB) vs no cache",
             lambda cm, h8, m: _context(cm, m, 0.5)),
    Scenario("context-cache-cm384-90", "prefill with 90 % of prompt tokens in EMS (UB) vs no cache",
             lambda cm, h8, m: _context(cm, m, 0.9)),
    Scenario("model-cache-671b-8", "671 GB checkpoint, 8 instances, 2.5 GB/s object storage",
             lambda cm, h8, m: (lambda r: {"direct_s": r.direct_s, "ems_s": r.ems_s})(model_cache(cm, 671, 8, 2.5))),
    Scenario("allocation-224-10.08", "224-NPU supernodes, mean block 10.08",
             lambda cm, h8, m: _alloc(224, 10.08)),
    Scenario("allocation-384-10.08", "384-NPU supernodes, mean block 10.08",
             lambda cm, h8, m: _alloc(384, 10.08)),
    Scenario("allocation-224-11.28", "224-NPU supernodes, mean block 11.28",
             lambda cm, h8, m: _alloc(224, 11.28)),
]


def paper_tables(cloudmatrix: str = "cloudmatrix384", h800: str = "h800", model: str = "deepseek-r1",
                 progress: Callable[[str], None] | None = None) -> dict:
    """{"scenarios": {id: {metric: value}}} for every scenario."""
    cm, h8, m = load_hardware(cloudmatrix), load_hardware(h800), load_model(model)
    out = {}
    for sc in SCENARIOS:
        out[sc.id] = {k: float(v) for k, v in sc.run(cm, h8, m).items()}
        if progress:
            progress(sc.id)
    return {"scenarios": out}
