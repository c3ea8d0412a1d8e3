"""Prefill of one batch on one device: SP-TP-SP MLA (CloudMatrix) or data-parallel MLA.

SP-TP-SP over P devices, per layer and microbatch (tokens of all prompts concatenated and
cut evenly, so every device gets the same work whatever the prompt lengths):
  stage 1 (SP)   q_a, kv_a down-projections on the device's own tokens
  all-gather     the compressed latents (q 1536 + kv 576 per token) to all P devices
  stage 2 (TP)   q_b, kv_b and attention for heads/P heads over all tokens
  all-to-all     attention outputs back to the token owners
  stage 3 (SP)   o_proj on own tokens
  MoE            gate, dispatch, experts (EP), combine
DP: each device runs whole prompts with all heads; no attention communication, but the
batch ends when the device with the most work finishes.
A cached prefix (EMS context cache) removes the new-token work of the cached positions, but
not for free: each prompt's prefix is looked up (a round trip to the MP server), its latent
KV is read from the pool over UB or VPC (bandwidth per reader: its link, or its share of the
EMS sockets' memory bandwidth among `ems_readers` readers) and expanded by kv_b for the TP
heads, and the new tokens still attend over the whole prefix. Queueing at the prefill
instances is the discrete-event simulation's (serving.py): the load is part of the service.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from matrixinfer.sim import costs
from matrixinfer.sim.costs import BYTES, Op, OpTimes
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec


@dataclass(frozen=True)
class PrefillConfig:
    tokens_per_device: float = 16384  # prompt tokens per device per batch (cached ones included)
    prompt_len: float = 4096
    devices: int = 32  # devices of one prefill instance
    ep: int = 32
    attention: str = "sp-tp-sp"  # or "tp", "dp"
    weight_precision: str = "int8"
    dispatch_precision: str = "int8"
    kv_precision: str = "bf16"
    latent_precision: str = "bf16"  # of the SP -> TP all-gather
    microbatches: int = 2
    expert_imbalance: float = 1.0
    cache_hit: float = 0.0  # fraction of prompt tokens found in the EMS context cache
    page_plane: str = "ub"  # "ub" or "vpc": where cached KV pages are read from
    ems_readers: int = 192  # devices reading the pool at once (6 prefill instances x 32 dies)
    ems_lookup_us: float = 10.0  # assumption: metadata service time of one prefix lookup
    prefix_in_hbm: bool = False  # the cached part is earlier chunks of the same prompt: no lookup, no page reads
    hierarchical_ep: bool = False  # GPU clusters: RDMA between nodes + NVLink inside
    moe_tokens_per_device: float | None = None  # EP load per device if it differs from this
    # device's own tokens (DP: experts see the group's mean, attention only its own prompts)
    overlap: float | None = None

    def __post_init__(self):
        if self.attention not in ("sp-tp-sp", "tp", "dp"):
            raise ValueError(f"attention must be 'sp-tp-sp', 'tp' or 'dp', got {self.attention!r}")
        if not 0 <= self.cache_hit < 1:
            raise ValueError("cache_hit must be in [0, 1)")
        if self.page_plane not in ("ub", "vpc"):
            raise ValueError("page_plane must be 'ub' or 'vpc'")


@dataclass(frozen=True)
class PrefillResult:
    batch_s: float  # compute of one batch on one device
    kv_load_s: float  # reading cached KV pages before the batch
    ttft_s: float  # kv_load + batch (a request waits for its whole batch)
    tokens_per_s_per_device: float  # kv loading pipelined with the previous batch
    breakdown_s: dict = field(default_factory=dict)


def page_read_gb_s(hw: HardwareSpec, plane: str, readers: int) -> float:
    """Bandwidth one device gets reading KV pages from the EMS pool.

    UB: the device's UB bandwidth, capped by its share of the CPU sockets' memory bandwidth.
    VPC: the node's VPC bandwidth shared by the devices of the node."""
    eff = hw.efficiency.link
    if plane == "vpc":
        return hw.vpc_node_gb_s * eff / hw.devices_per_node
    pool = hw.cpu_sockets * hw.cpu_mem_gb_s / max(1, readers) if hw.cpu_sockets else float("inf")
    return min(hw.scale_up.gb_s * eff, pool)


def _attention_path(hw, model: ModelSpec, cfg: PrefillConfig, new: float, cached: float, pairs: float) -> tuple[OpTimes, dict]:
    w = cfg.weight_precision
    q_out = model.heads * model.qk_dim
    kv_a = model.hidden * (model.kv_lora_rank + model.qk_rope_dim)
    q_a = model.hidden * model.q_lora_rank if model.q_lora_rank else 0
    q_b = (model.q_lora_rank or model.hidden) * q_out
    kv_b = model.kv_lora_rank * model.heads * (model.qk_nope_dim + model.v_dim)
    o = model.heads * model.v_dim * model.hidden
    ops = [Op("mla_down", 2 * new * (q_a + kv_a), (q_a + kv_a) * BYTES[w], w),
           Op("mla_up_q", 2 * new * q_b, q_b * BYTES[w], w),
           Op("mla_up_kv", 2 * (new + cached) * kv_b, kv_b * BYTES[w], w),
           costs.attention_core_op(model, pairs, new + cached, cfg.kv_precision, absorbed=False),
           Op("o_proj", 2 * new * o, o * BYTES[w], w)]
    comm, parts = 0.0, {}
    if cfg.attention == "sp-tp-sp" and cfg.devices > 1:
        P = cfg.devices
        latent = new * ((model.q_lora_rank or 0) + model.kv_lora_rank + model.qk_rope_dim) \
            + cached * (model.kv_lora_rank + model.qk_rope_dim)
        gather = costs.all_to_all_time((P - 1) * latent * BYTES[cfg.latent_precision], P - 1, hw.scale_up, hw.efficiency.link)
        back = costs.all_to_all_time((P - 1) / P * new * model.heads * model.v_dim * BYTES["bf16"], P - 1,
                                     hw.scale_up, hw.efficiency.link)
        comm = gather + back
        parts = {"all_gather": gather, "all_to_all": back}
    elif cfg.attention == "tp" and cfg.devices > 1:
        # plain TP: the instance's hidden states are all-gathered, the down-projections run
        # replicated on all P x new tokens, heads are split; o_proj outputs are reduce-scattered
        P = cfg.devices
        ops[0] = Op("mla_down", 2 * P * new * (q_a + kv_a), (q_a + kv_a) * BYTES[w], w)
        hid = (P - 1) * new * model.hidden * BYTES["bf16"]
        gather = costs.all_to_all_time(hid, P - 1, hw.scale_up, hw.efficiency.link)
        back = costs.all_to_all_time(hid, P - 1, hw.scale_up, hw.efficiency.link)
        comm = gather + back
        parts = {"all_gather": gather, "reduce_scatter": back}
    return OpTimes.of(ops, hw, comm_s=comm), parts


def _moe_path(hw, model: ModelSpec, cfg: PrefillConfig, new: float) -> tuple[OpTimes, dict]:
    w = cfg.weight_precision
    experts_here = model.routed_experts / cfg.ep
    pairs = new * model.top_k * cfg.expert_imbalance + new * model.shared_experts  # shared expert local
    ops = [costs.gate_op(model, new), costs.expert_op(model, pairs, experts_here + model.shared_experts, w)]
    comm = costs.ep_comm(hw, model, new, cfg.ep, cfg.dispatch_precision, plane="scale_up",
                         hierarchical=cfg.hierarchical_ep)
    return OpTimes.of(ops, hw, comm_s=comm.dispatch_s + comm.combine_s), {"dispatch": comm.dispatch_s,
                                                                         "combine": comm.combine_s}


def prefill_batch(hw: HardwareSpec, model: ModelSpec, cfg: PrefillConfig) -> PrefillResult:
    overlap = hw.efficiency.overlap if cfg.overlap is None else cfg.overlap
    mb = cfg.microbatches
    n_prompts = cfg.tokens_per_device / cfg.prompt_len
    cached_len = cfg.cache_hit * cfg.prompt_len
    new = cfg.tokens_per_device * (1 - cfg.cache_hit) / mb
    cached = cfg.tokens_per_device * cfg.cache_hit / mb
    pairs = n_prompts * costs.causal_pairs(cfg.prompt_len, cached_len) / mb
    attn, parts = _attention_path(hw, model, cfg, new, cached, pairs)
    t_moe_layer = t_dense_layer = 0.0
    if model.routed_experts:
        moe_new = new if cfg.moe_tokens_per_device is None else cfg.moe_tokens_per_device * (1 - cfg.cache_hit) / mb
        moe, moe_parts = _moe_path(hw, model, cfg, moe_new)
        parts.update(moe_parts)
        t_moe_layer = mb * (costs.overlapped_time(attn, moe, overlap) if mb > 1 else attn.time_s + moe.time_s)
    ffn = OpTimes.of([costs.dense_ffn_op(model, new, cfg.weight_precision)], hw)
    t_dense_layer = mb * (attn.time_s + ffn.time_s)
    head = costs.op_time(costs.lm_head_op(model, n_prompts), hw).time_s  # logits of the last position only
    batch = model.moe_layers * t_moe_layer + (model.layers - model.moe_layers) * t_dense_layer + head
    kv_bytes = cfg.tokens_per_device * cfg.cache_hit * model.layers * model.kv_elems_per_token_layer() \
        * BYTES[cfg.kv_precision]
    if cfg.prefix_in_hbm:
        kv_bytes = 0.0
    load = kv_bytes / (page_read_gb_s(hw, cfg.page_plane, cfg.ems_readers) * 1e9) if kv_bytes else 0.0
    look = n_prompts * context_lookup_s(hw, cfg) if cfg.cache_hit and not cfg.prefix_in_hbm else 0.0
    # what reuse does not save: the new tokens still attend over the whole cached prefix
    unsaved = mb * costs.op_time(costs.attention_core_op(
        model, n_prompts * (cfg.prompt_len - cached_len) * cached_len / mb, 0, cfg.kv_precision, False), hw).time_s
    breakdown = {"moe_layers": model.moe_layers * t_moe_layer, "dense_layers": (model.layers - model.moe_layers) * t_dense_layer,
                 "lm_head": head, "kv_load": load, "lookup": look, "prefix_attention_per_layer": unsaved,
                 **{f"{k}_per_layer_mb": v for k, v in parts.items()}}
    # the lookup precedes the page reads; page reads of the next batch overlap this batch's compute
    return PrefillResult(batch, load + look, look + load + batch, cfg.tokens_per_device / max(batch, load + look),
                         breakdown)


def context_lookup_s(hw: HardwareSpec, cfg: PrefillConfig) -> float:
    """One prompt's EMS lookup: a round trip to the MP server's metadata over the page plane
    plus its service time (which pages hold the prefix; the hash is computed on the host)."""
    latency = hw.scale_up.latency_us if cfg.page_plane == "ub" else hw.scale_out.latency_us
    return (2 * latency + cfg.ems_lookup_us) * 1e-6


# ---------------------------------------------------------------- DP vs SP-TP-SP balance

@dataclass(frozen=True)
class BalanceResult:
    dp_s: float
    sptp_s: float
    dp_efficiency: float  # mean device work / max device work under DP
    speedup: float  # dp_s / sptp_s
    tp_s: float = 0.0  # plain TP: hidden states all-gathered, down-projections replicated on all tokens


def prefill_balance(hw: HardwareSpec, model: ModelSpec, lengths: list[int], devices: int = 32,
                    **overrides) -> BalanceResult:
    """One batch of prompts of the given lengths on `devices` devices, DP vs SP-TP-SP (and TP).

    Per-token and per-attention-pair costs come from prefill_batch; DP places each prompt on
    the device with the fewest tokens so far (what a DP scheduler can do without knowing
    the future). Every MoE layer is an all-to-all over the group, so its expert work is the
    group mean while attention is each device's own: the busiest device sets the pace.
    """
    tokens = sum(lengths)
    pairs = [costs.causal_pairs(L) for L in lengths]

    mean_tokens = tokens / devices

    def time_for(attention: str, n_tokens: float, n_pairs: float) -> float:
        # express the work as an equivalent batch of equal prompts with the same token and pair counts
        eq_len = max(1.0, 2 * n_pairs / n_tokens - 1)
        cfg = PrefillConfig(tokens_per_device=n_tokens, prompt_len=eq_len, devices=devices, ep=devices,
                            attention=attention, moe_tokens_per_device=mean_tokens, **overrides)
        return prefill_batch(hw, model, cfg).batch_s

    load_tokens = [0.0] * devices
    load_pairs = [0.0] * devices
    for L, p in zip(lengths, pairs):  # in arrival order
        d = min(range(devices), key=lambda i: load_tokens[i])
        load_tokens[d] += L
        load_pairs[d] += p
    dp_times = [time_for("dp", t, p) if t else 0.0 for t, p in zip(load_tokens, load_pairs)]
    dp = max(dp_times)
    sptp = time_for("sp-tp-sp", mean_tokens, sum(pairs) / devices)
    tp = time_for("tp", mean_tokens, sum(pairs) / devices)
    return BalanceResult(dp, sptp, (sum(dp_times) / devices) / dp, dp / sptp, tp)
