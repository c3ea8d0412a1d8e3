"""Pure cost model: operator rooflines and collective (all-to-all) times.

Every function here takes numbers and specs and returns seconds (or bytes / FLOPs); nothing
keeps state, so a test can check each against a hand computation.

Roofline of one operator:  t = max(FLOPs / (peak * eff_compute), bytes / (HBM_bw * eff_memory)).
All-to-all of one device:  t = latency + bytes_out / (plane_bw * eff_link) + peers * per_peer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from matrixinfer.sim.hardware import HardwareSpec, PlaneSpec
from matrixinfer.sim.modelspec import ModelSpec

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# Per-token routing metadata sent with a quantized token: SPEC's 7.5 KB INT8 token
# (7,168 B payload + 4 B scale) leaves 508 B for expert ids, weights and position.
DISPATCH_METADATA_BYTES = 508


@dataclass(frozen=True)
class Op:
    """One operator on one device: work (FLOPs) and HBM traffic (bytes) at a precision."""

    name: str
    flops: float
    bytes: float
    precision: str
    kind: str = "gemm"  # "gemm" (matrix unit, GEMM efficiency) or "attention" (MLA efficiencies)


@dataclass(frozen=True)
class OpTime:
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)


def op_time(op: Op, hw: HardwareSpec) -> OpTime:
    eff_c = hw.efficiency.mla_compute if op.kind == "attention" else hw.gemm_efficiency(op.precision)
    compute = op.flops / (hw.peak_flops(op.precision) * eff_c) if op.flops else 0.0
    memory = op.bytes / (hw.device.hbm_tb_s * 1e12 * hw.efficiency.mla_memory)
    return OpTime(compute, memory)


# ---------------------------------------------------------------- operators of one layer

def attention_proj_op(model: ModelSpec, tokens: float, precision: str, absorbed: bool) -> Op:
    """Projections of one attention block (MLA prolog + o_proj) for `tokens` tokens.

    Decode uses the weight-absorbed form: kv_b is split into W_UK (folded into the query)
    and W_UV (applied to the attention output), so the same weights are read either way.
    Prefill (absorbed=False) runs kv_b on every token's latent, the same parameter count.
    """
    params = model.attention_params()
    w_bytes = params * BYTES[precision]
    act_bytes = tokens * model.hidden * BYTES["bf16"] * 4  # in/out of the fused prolog and o_proj
    return Op("attention_proj", 2.0 * tokens * params, w_bytes + act_bytes, precision)


def attention_core_flops_per_query_pos(model: ModelSpec, absorbed: bool) -> float:
    """FLOPs for one query token attending to one cached position, all heads.

    Absorbed MLA (decode): scores over the 576-wide latent (512 + 64), values over 512.
    Expanded MLA / GQA (prefill): scores over qk_nope + rope, values over v_dim.
    """
    if model.is_mla and absorbed:
        return 2.0 * model.heads * (model.kv_lora_rank + model.qk_rope_dim + model.kv_lora_rank)
    return 2.0 * model.heads * (model.qk_dim + model.v_dim)


def attention_core_op(model: ModelSpec, query_pos_pairs: float, kv_tokens_read: float,
                      kv_precision: str, absorbed: bool, compute_precision: str = "bf16") -> Op:
    """FlashAttention-style core: `query_pos_pairs` (query, cached position) pairs of work,
    `kv_tokens_read` cached tokens read from HBM once."""
    flops = attention_core_flops_per_query_pos(model, absorbed) * query_pos_pairs
    kv_bytes = kv_tokens_read * model.kv_elems_per_token_layer() * BYTES[kv_precision]
    return Op("attention_core", flops, kv_bytes, compute_precision, kind="attention")


def causal_pairs(prompt_len: float, cached: float = 0.0) -> float:
    """Sum of attended positions for new tokens cached+1..prompt_len of one prompt."""
    return (prompt_len * (prompt_len + 1) - cached * (cached + 1)) / 2.0


def expert_op(model: ModelSpec, tokens: float, experts: float, precision: str) -> Op:
    """Grouped expert GEMMs on one device: `tokens` token-expert pairs over `experts` experts."""
    p = model.expert_params()
    return Op("experts", 2.0 * tokens * p, experts * p * BYTES[precision] + tokens * model.hidden * 4, precision)


def gate_op(model: ModelSpec, tokens: float) -> Op:
    p = model.hidden * model.routed_experts
    return Op("gate", 2.0 * tokens * p, p * BYTES["bf16"], "bf16")


def dense_ffn_op(model: ModelSpec, tokens: float, precision: str) -> Op:
    p = model.dense_ffn_params()
    return Op("dense_ffn", 2.0 * tokens * p, p * BYTES[precision] + tokens * model.hidden * 4, precision)


def lm_head_op(model: ModelSpec, tokens: float) -> Op:
    p = model.vocab * model.hidden
    return Op("lm_head", 2.0 * tokens * p, p * BYTES["bf16"], "bf16")


# ---------------------------------------------------------------- expert-parallel traffic

def token_bytes(hidden: int, precision: str) -> float:
    """Bytes of one token on the wire. Quantized tokens carry a scale and routing metadata
    (INT8: one fp32 scale per token; FP8: one per 128 channels, as DeepEP)."""
    if precision == "int8":
        return hidden + 4 + DISPATCH_METADATA_BYTES
    if precision == "fp8":
        return hidden + 4 * math.ceil(hidden / 128) + DISPATCH_METADATA_BYTES
    return hidden * BYTES[precision]


def expected_distinct_ranks(top_k: int, experts: int, ranks: int) -> float:
    """Expected number of distinct ranks a token's top-k experts live on, experts spread
    evenly over `ranks` and chosen uniformly: ranks * (1 - C(E - E/r, k) / C(E, k))."""
    if ranks >= experts:
        return float(top_k)
    per_rank = experts // ranks
    miss = math.comb(experts - per_rank, top_k) / math.comb(experts, top_k)
    return ranks * (1.0 - miss)


def all_to_all_time(bytes_out: float, peers: float, plane: PlaneSpec, link_eff: float) -> float:
    """One device's side of an all-to-all on one plane (seconds)."""
    if bytes_out <= 0:
        return 0.0
    return plane.latency_us * 1e-6 + bytes_out / (plane.gb_s * 1e9 * link_eff) + peers * plane.per_peer_us * 1e-6


@dataclass(frozen=True)
class EPComm:
    dispatch_s: float
    combine_s: float
    dispatch_bytes: float
    combine_bytes: float
    dispatch_terms: dict = field(default_factory=dict)  # term -> seconds, summing to dispatch_s
    combine_terms: dict = field(default_factory=dict)


def hbm_pass_time(hw: HardwareSpec, nbytes: float) -> float:
    """A vector-core pass over `nbytes` of HBM (quantize, reorder, reduce): memory-bound at
    the measured memory-bound efficiency."""
    return nbytes / (hw.device.hbm_tb_s * 1e12 * hw.efficiency.mla_memory)


def sync_round_time(hw: HardwareSpec, plane: PlaneSpec, peers: float) -> float:
    """One synchronisation round of a fused kernel: flag writes to `peers` peers, the one-way
    latency of the plane and the handshake (remote poll sees the flag)."""
    return plane.latency_us * 1e-6 + hw.collective.handshake_us * 1e-6 + peers * plane.per_peer_us * 1e-6


def dispatch_terms(hw: HardwareSpec, plane: PlaneSpec, tokens: float, copies: float, hidden: int,
                   precision: str, wire_s: float, peers: float) -> dict:
    """Terms of one fused dispatch on one device (seconds).

    launch; quantize (read BF16 tokens, write the quantized ones: a memory pass, only when
    the wire precision is narrower); metadata exchange (per-expert token counts, one
    synchronisation round before data can be placed); the payload on the wire with its
    data-ready round (`wire_s`, from all_to_all_time, plus the handshake); receive-side
    reorder of every received copy into expert-major order (read + write).
    """
    tok = token_bytes(hidden, precision)
    quant = hbm_pass_time(hw, tokens * hidden * BYTES["bf16"] + tokens * tok) if precision in ("int8", "fp8") else 0.0
    return {"launch": hw.collective.launch_us * 1e-6, "quantize": quant,
            "metadata": hw.collective.metadata_rounds * sync_round_time(hw, plane, peers),
            "payload": wire_s + hw.collective.handshake_us * 1e-6,
            "reorder": hbm_pass_time(hw, 2 * tokens * copies * tok)}


def combine_terms(hw: HardwareSpec, tokens: float, copies: float, hidden: int, precision: str, wire_s: float) -> dict:
    """Terms of one fused combine: launch; the payload with one data-ready round (the layout is
    known from dispatch, no metadata exchange); the weighted sum of each token's returned
    copies (read every copy, write one BF16 token)."""
    tok = token_bytes(hidden, precision)
    return {"launch": hw.collective.launch_us * 1e-6,
            "payload": wire_s + hw.collective.handshake_us * 1e-6,
            "reduce": hbm_pass_time(hw, tokens * copies * tok + tokens * hidden * BYTES["bf16"])}


def ep_comm(hw: HardwareSpec, model: ModelSpec, tokens: float, ep: int, dispatch_precision: str,
            combine_precision: str = "bf16", extra_dests: float = 0.0, plane: str | None = None,
            hierarchical: bool = False, dedup_ranks: bool = True) -> EPComm:
    """Dispatch and combine of `tokens` tokens per device over an EP group of `ep` devices.

    Each token goes once to every distinct rank holding one of its top-k experts (plus
    `extra_dests`, e.g. a shared expert on another device); a fraction 1/ep stays local.
    Low-latency kernels (DeepEP LL, CloudMatrix FusedDispatch) write one copy per selected
    expert instead (`dedup_ranks=False`): top_k copies per token.
    Combine sends the expert outputs back along the same routes.
    `hierarchical` (GPU clusters, DeepEP normal kernels): inter-node traffic is sent once
    per destination node over RDMA and forwarded over NVLink; the wire time is the slower plane.
    Around the wire time both kernels pay the fixed and memory terms of dispatch_terms /
    combine_terms.
    """
    routed = expected_distinct_ranks(model.top_k, model.routed_experts, ep) if dedup_ranks else model.top_k
    dests = routed + extra_dests
    remote = (ep - 1) / ep
    peers = min(ep - 1, tokens * dests)
    d_tok, c_tok = token_bytes(model.hidden, dispatch_precision), token_bytes(model.hidden, combine_precision)
    eff = hw.efficiency.link
    if tokens <= 0 or ep <= 1:  # nothing leaves the device: no kernel at all
        return EPComm(0.0, 0.0, 0.0, 0.0)
    if hierarchical and ep > hw.scale_up.domain:
        node = hw.scale_up.domain
        nodes = ep // node
        node_dests = expected_distinct_ranks(model.top_k, model.routed_experts, nodes) * (nodes - 1) / nodes
        wires = [max(all_to_all_time(tokens * node_dests * tok, nodes - 1, hw.scale_out, eff),
                     all_to_all_time(tokens * dests * remote * tok, node - 1, hw.scale_up, eff))
                 for tok in (d_tok, c_tok)]
        p, peers = hw.scale_out, nodes - 1
        d_bytes, c_bytes = tokens * node_dests * d_tok, tokens * node_dests * c_tok
    else:
        p = hw.plane(plane or hw.ep_decode_plane)
        d_bytes, c_bytes = tokens * dests * remote * d_tok, tokens * dests * remote * c_tok
        wires = [all_to_all_time(d_bytes, peers, p, eff), all_to_all_time(c_bytes, peers, p, eff)]
    dt = dispatch_terms(hw, p, tokens, dests, model.hidden, dispatch_precision, wires[0], peers)
    ct = combine_terms(hw, tokens, dests, model.hidden, combine_precision, wires[1])
    return EPComm(sum(dt.values()), sum(ct.values()), d_bytes, c_bytes, dt, ct)


# ---------------------------------------------------------------- expert load balance

def eplb_slot_loads(expert_loads: list[float], slots: int) -> list[float]:
    """EPLB model: give `slots - len(expert_loads)` redundant replicas, one at a time, to the
    expert whose per-replica load is highest; replicas of an expert split its load evenly.
    Returns the load of every slot (one slot = one device holding one expert copy)."""
    from matrixinfer.parallel.eplb import replicate  # the engine's own replication rule

    n = len(expert_loads)
    if slots < n:
        raise ValueError(f"need at least one slot per expert ({n}), got {slots}")
    copies = replicate(expert_loads, slots)[1]
    return [expert_loads[e] / copies[e] for e in range(n) for _ in range(copies[e])]


def eplb_imbalance(expert_loads: list[float], slots: int) -> float:
    """Max slot load over mean slot load after EPLB replication (1.0 = perfect balance)."""
    loads = eplb_slot_loads(expert_loads, slots)
    return max(loads) / (sum(loads) / len(loads))


def zipf_loads(experts: int, skew: float) -> list[float]:
    """Expert popularity  ~ 1 / rank^skew  (skew 0 = uniform), summing to 1."""
    w = [1.0 / (r + 1) ** skew for r in range(experts)]
    s = sum(w)
    return [x / s for x in w]


# ---------------------------------------------------------------- microbatch overlap

def overlapped_time(path_a: OpTimes, path_b: OpTimes, overlap: float) -> float:
    """Time of one slot in which path A (attention of one microbatch) runs beside path B
    (MoE of the other) on the same device.

    Ideal: the longer path, but never less than the shared compute or HBM resource needs
    (both streams use the same cores and memory). Serial: A + B. `overlap` in [0, 1] is the
    fraction of the gap between serial and ideal that the two-stream pipeline recovers.
    """
    serial = path_a.time_s + path_b.time_s
    ideal = max(path_a.time_s, path_b.time_s, path_a.compute_s + path_b.compute_s,
                path_a.memory_s + path_b.memory_s)
    return ideal + (1.0 - overlap) * (serial - ideal)


@dataclass(frozen=True)
class OpTimes:
    """Sum over a sequence of operators (plus communication, which uses neither resource)."""

    time_s: float  # sum of per-op rooflines + comm
    compute_s: float
    memory_s: float

    @staticmethod
    def of(ops: list[Op], hw: HardwareSpec, comm_s: float = 0.0) -> "OpTimes":
        ts = [op_time(o, hw) for o in ops]
        return OpTimes(sum(t.time_s for t in ts) + comm_s, sum(t.compute_s for t in ts), sum(t.memory_s for t in ts))
