"""Decode step of a DP-attention / EP-MoE instance (CloudMatrix LEP, DeepSeek's EP128).

One step on one device, with `batch` sequences per device, split into microbatches:

  per layer and microbatch   attention path  A = MLA prolog + attention core (+ dense FFN)
                             MoE path        M = gate + dispatch + experts + combine
  two microbatches           slot = overlapped_time(A, M); layer = microbatches * slot
  step                       = sum over layers + lm_head + MTP drafts (+ host syncs if the
                               MTP graphs are not pipelined)
  MTP with k drafts accepted with probability a each: tokens per step = 1 + a + ... + a^k
  TPOT = step / tokens per step;  throughput per device = batch / TPOT
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from matrixinfer.sim import costs
from matrixinfer.sim.costs import OpTimes
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec


@dataclass(frozen=True)
class DecodeConfig:
    batch_per_device: float
    kv_len: float
    ep: int = 320
    weight_precision: str = "int8"
    dispatch_precision: str = "int8"
    kv_precision: str = "bf16"
    mtp_drafts: int = 1
    mtp_acceptance: float = 0.7
    microbatches: int = 2
    shared_expert_devices: int | None = None  # devices with shared-expert replicas; 0 = computed locally,
    # None = a tenth of the EP group when the rest still holds every routed expert (EP320: 32), else 0
    expert_imbalance: float = 1.0  # busiest routed-expert device / mean, after EPLB
    pipelined_mtp: bool = True
    host_sync_ms: float = 0.7  # one host round trip per graph launch when not pipelined
    overlap: float | None = None  # None = the hardware's (fitted) overlap efficiency

    def __post_init__(self):
        if self.batch_per_device <= 0 or self.kv_len < 0:
            raise ValueError("batch_per_device must be > 0 and kv_len >= 0")
        if not 0 <= self.mtp_acceptance <= 1:
            raise ValueError("mtp_acceptance must be in [0, 1]")
        if self.microbatches < 1 or self.ep < 1:
            raise ValueError("microbatches and ep must be >= 1")


@dataclass(frozen=True)
class DecodeResult:
    step_ms: float
    tokens_per_step: float  # per sequence
    tpot_ms: float
    tokens_per_s_per_device: float
    breakdown_ms: dict = field(default_factory=dict)


def mtp_tokens_per_step(drafts: int, acceptance: float) -> float:
    """Expected tokens emitted per step: the verified token plus each draft accepted only if
    all earlier ones were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance**i for i in range(drafts + 1))


def shared_expert_devices(model: ModelSpec, cfg: DecodeConfig) -> int:
    if cfg.shared_expert_devices is not None:
        return cfg.shared_expert_devices
    tenth = cfg.ep // 10
    return tenth if cfg.ep - tenth >= model.routed_experts else 0


def _moe_layout(model: ModelSpec, cfg: DecodeConfig) -> tuple[int, float, bool]:
    """(routed slots, experts per routed device, shared expert remote?)"""
    shared_devs = shared_expert_devices(model, cfg)
    shared_remote = shared_devs > 0 and model.shared_experts > 0
    slots = cfg.ep - (shared_devs if shared_remote else 0)
    if slots < 1:
        raise ValueError(f"EP{cfg.ep} leaves no device for routed experts")
    return slots, max(1.0, model.routed_experts / slots), shared_remote


def moe_path(hw: HardwareSpec, model: ModelSpec, cfg: DecodeConfig, tokens_per_device: float) -> tuple[OpTimes, dict]:
    """MoE of one microbatch on the busiest device: gate, dispatch, experts, combine."""
    slots, experts_per_dev, shared_remote = _moe_layout(model, cfg)
    global_tokens = tokens_per_device * cfg.ep
    # token-expert pairs on the busiest routed device (replicas share a hot expert's load)
    routed_pairs = global_tokens * model.top_k / slots * cfg.expert_imbalance
    if shared_remote:
        shared_pairs = global_tokens * model.shared_experts / shared_expert_devices(model, cfg)
        candidates = [costs.expert_op(model, routed_pairs, experts_per_dev, cfg.weight_precision),
                      costs.expert_op(model, shared_pairs, model.shared_experts, cfg.weight_precision)]
        expert_ops = [max(candidates, key=lambda o: costs.op_time(o, hw).time_s)]
    else:  # every device also runs the shared expert on its own tokens
        expert_ops = [costs.expert_op(model, routed_pairs + tokens_per_device * model.shared_experts,
                                      experts_per_dev + model.shared_experts, cfg.weight_precision)]
    comm = costs.ep_comm(hw, model, tokens_per_device, cfg.ep, cfg.dispatch_precision,
                         extra_dests=1.0 if shared_remote else 0.0,
                         plane=hw.ep_decode_plane, dedup_ranks=False)
    ops = [costs.gate_op(model, tokens_per_device)] + expert_ops
    path = OpTimes.of(ops, hw, comm_s=comm.dispatch_s + comm.combine_s)
    return path, {"dispatch": comm.dispatch_s, "combine": comm.combine_s,
                  "experts": path.time_s - comm.dispatch_s - comm.combine_s}


def attention_path(hw: HardwareSpec, model: ModelSpec, cfg: DecodeConfig, seqs: float, tokens: float,
                   dense_ffn: bool) -> OpTimes:
    ops = [costs.attention_proj_op(model, tokens, cfg.weight_precision, absorbed=True),
           costs.attention_core_op(model, tokens * cfg.kv_len, seqs * cfg.kv_len, cfg.kv_precision, absorbed=True)]
    if dense_ffn:
        ops.append(costs.dense_ffn_op(model, tokens, cfg.weight_precision))
    return OpTimes.of(ops, hw)


def _layer_time(hw, model, cfg, seqs_per_mb, tokens_per_mb, moe: bool, overlap: float) -> float:
    attn = attention_path(hw, model, cfg, seqs_per_mb, tokens_per_mb, dense_ffn=not moe)
    if not moe:
        return cfg.microbatches * attn.time_s
    moe_t, _ = moe_path(hw, model, cfg, tokens_per_mb)
    if cfg.microbatches == 1:
        return attn.time_s + moe_t.time_s
    return cfg.microbatches * costs.overlapped_time(attn, moe_t, overlap)


def decode_step(hw: HardwareSpec, model: ModelSpec, cfg: DecodeConfig) -> DecodeResult:
    if cfg.mtp_drafts and not model.mtp_layers:  # a model without an MTP module cannot draft
        cfg = replace(cfg, mtp_drafts=0)
    overlap = hw.efficiency.overlap if cfg.overlap is None else cfg.overlap
    mb = cfg.microbatches
    seqs = cfg.batch_per_device
    main_tokens = seqs * (cfg.mtp_drafts + 1)  # verified token + drafts, per device
    moe = model.routed_experts > 0
    t_moe_layer = _layer_time(hw, model, cfg, seqs / mb, main_tokens / mb, moe=True, overlap=overlap) if moe else 0.0
    t_dense_layer = _layer_time(hw, model, cfg, seqs / mb, main_tokens / mb, moe=False, overlap=overlap)
    t_layers = model.moe_layers * t_moe_layer + (model.layers - model.moe_layers) * t_dense_layer
    t_head = costs.op_time(costs.lm_head_op(model, main_tokens), hw).time_s
    # each draft: one MTP block (an MoE layer + eh_proj) and the shared head, on `seqs` tokens
    t_mtp = 0.0
    if cfg.mtp_drafts:
        eh = costs.Op("mtp_eh_proj", 2.0 * seqs * 2 * model.hidden * model.hidden,
                      2 * model.hidden * model.hidden * costs.BYTES[cfg.weight_precision], cfg.weight_precision)
        one = (_layer_time(hw, model, cfg, seqs / mb, seqs / mb, moe=moe, overlap=overlap)
               + costs.op_time(eh, hw).time_s + costs.op_time(costs.lm_head_op(model, seqs), hw).time_s)
        t_mtp = cfg.mtp_drafts * one
    t_sync = 0.0 if cfg.pipelined_mtp else (cfg.mtp_drafts + 1) * cfg.host_sync_ms * 1e-3
    t_sync += (hw.host.step_overhead_us + hw.host.per_seq_us * seqs) * 1e-6  # eager engines (0 in graph mode)
    step = t_layers + t_head + t_mtp + t_sync
    per_step = mtp_tokens_per_step(cfg.mtp_drafts, cfg.mtp_acceptance)
    tpot = step / per_step
    breakdown = {"moe_layers": model.moe_layers * t_moe_layer * 1e3,
                 "dense_layers": (model.layers - model.moe_layers) * t_dense_layer * 1e3,
                 "lm_head": t_head * 1e3, "mtp": t_mtp * 1e3, "host_sync": t_sync * 1e3}
    return DecodeResult(step * 1e3, per_step, tpot * 1e3, seqs / tpot, breakdown)


def layer_paths_us(hw: HardwareSpec, model: ModelSpec, cfg: DecodeConfig) -> dict:
    """Attention and MoE path of one MoE layer and microbatch, in microseconds (for reports)."""
    mb = cfg.microbatches
    seqs = cfg.batch_per_device
    tokens = seqs * (cfg.mtp_drafts + 1) / mb
    attn = attention_path(hw, model, cfg, seqs / mb, tokens, dense_ffn=False)
    moe_t, parts = moe_path(hw, model, cfg, tokens)
    return {"attention": attn.time_s * 1e6, "moe": moe_t.time_s * 1e6, **{k: v * 1e6 for k, v in parts.items()}}
