"""One engine instance on one device (this machine): the cost model `simulate validate` holds
against the real engine.

The same operator rooflines as the supernode model (costs.py), with the terms an eager,
single-device engine adds and a supernode's graph-mode instance does not:
  decode step  = host.step_overhead + host.per_seq x batch + ops x host.op_launch
                 + sum over operators of roofline(op)
  operators    per layer: MLA projections, absorbed attention core (plus the gather of the
               paged latents into one tensor: a read and a write of every cached token),
               gate + experts (MoE layers) or the dense FFN; then lm_head on one token per sequence
  prefill      the same with the expanded attention (kv_b on every cached latent, causal pairs),
               its operators scaled by host.prefill_factor (fitted once: the eager engine's
               per-sequence attention loop and padded expert groups are slower than rooflines)
No expert parallelism, no microbatches: every expert lives on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from matrixinfer.sim import costs
from matrixinfer.sim.costs import BYTES, Op
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec


@dataclass(frozen=True)
class LocalStep:
    time_s: float
    ops_s: float  # sum of operator rooflines
    host_s: float  # step overhead + per-sequence + launches
    n_ops: int


def _ffn_ops(model: ModelSpec, tokens: float, precision: str, moe: bool) -> list[Op]:
    if not moe:
        return [costs.dense_ffn_op(model, tokens, precision)]
    pairs = tokens * (model.top_k + model.shared_experts)
    touched = min(model.routed_experts, tokens * model.top_k) + model.shared_experts  # experts whose weights are read
    gate = Op("gate", 2.0 * tokens * model.hidden * model.routed_experts,
              model.hidden * model.routed_experts * BYTES[precision], precision)
    return [gate, costs.expert_op(model, pairs, touched, precision)]


def _layers(model: ModelSpec, per_layer) -> list[Op]:
    ops = []
    for layer in range(model.layers):
        ops += per_layer(moe=model.routed_experts > 0 and layer >= model.dense_layers)
    return ops


def _head(model: ModelSpec, seqs: float, precision: str) -> Op:
    p = model.vocab * model.hidden
    return Op("lm_head", 2.0 * seqs * p, p * BYTES[precision], precision)


def _total(hw: HardwareSpec, ops: list[Op], seqs: float, factor: float = 1.0) -> LocalStep:
    ops_s = factor * sum(costs.op_time(o, hw).time_s for o in ops)
    h = hw.host
    host = (h.step_overhead_us + h.per_seq_us * seqs + h.op_launch_us * len(ops)) * 1e-6
    return LocalStep(ops_s + host, ops_s, host, len(ops))


def decode_ops(model: ModelSpec, batch: int, kv_len: float, precision: str) -> list[Op]:
    kv_row = model.kv_elems_per_token_layer() * BYTES[precision]

    def layer(moe: bool) -> list[Op]:
        return [costs.attention_proj_op(model, batch, precision, absorbed=True),
                Op("latent_gather", 0.0, 2.0 * batch * kv_len * kv_row, precision),
                costs.attention_core_op(model, batch * kv_len, batch * kv_len, precision, True, precision),
                *_ffn_ops(model, batch, precision, moe)]

    return _layers(model, layer) + [_head(model, batch, precision)]


def prefill_ops(model: ModelSpec, prompts: int, prompt_len: int, precision: str) -> list[Op]:
    tokens = prompts * prompt_len
    pairs = prompts * costs.causal_pairs(prompt_len)

    def layer(moe: bool) -> list[Op]:
        return [costs.attention_proj_op(model, tokens, precision, absorbed=False),
                costs.attention_core_op(model, pairs, tokens, precision, False, precision),
                *_ffn_ops(model, tokens, precision, moe)]

    return _layers(model, layer) + [_head(model, prompts, precision)]


def decode_step(hw: HardwareSpec, model: ModelSpec, batch: int, kv_len: float, precision: str = "fp32") -> LocalStep:
    return _total(hw, decode_ops(model, batch, kv_len, precision), batch)


def prefill_step(hw: HardwareSpec, model: ModelSpec, prompts: int, prompt_len: int, precision: str = "fp32") -> LocalStep:
    """All prompts in one engine step (the token budget holds them)."""
    return _total(hw, prefill_ops(model, prompts, prompt_len, precision), prompts, hw.host.prefill_factor)


@dataclass(frozen=True)
class LocalRun:
    ttft_s: float
    decode_step_s: float
    throughput_tok_s: float  # output tokens per second of the whole generate call


def generate_run(hw: HardwareSpec, model: ModelSpec, batch: int, prompt_len: int, max_tokens: int,
                 precision: str = "fp32") -> LocalRun:
    """`generate` of `batch` prompts at once: one prefill step (first tokens), then
    max_tokens - 1 decode steps over the mean KV length of the decode."""
    ttft = prefill_step(hw, model, batch, prompt_len, precision).time_s
    step = decode_step(hw, model, batch, prompt_len + max_tokens / 2, precision).time_s
    total = ttft + (max_tokens - 1) * step
    return LocalRun(ttft, step, batch * max_tokens / total)
