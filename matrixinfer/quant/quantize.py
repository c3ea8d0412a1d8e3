"""The offline quantizer: a float DeepseekForCausalLM plus calibration statistics -> a W8A8
model (int8 weights + float32 per-channel scales), which save_pretrained writes in the
compressed-tensors layout.

Steps, each switchable (QuantizeOptions), in this order:
1. smoothing, folded so that no op is added at inference:
   input_layernorm -> q_a|kv_a (or q|kv_a);  q_a_layernorm -> q_b;  kv_b's value rows -> o_proj;
   post_attention_layernorm -> the dense MLP's gate|up, or the MoE's shared and routed
   experts' gate|up together;  every MLP and expert: up rows -> down.
   The router gate reads the MoE input too. It is never a smoothing target (its weights do not
   enter the factors and it stays float); its columns are multiplied by s, so it sees exactly
   the input it saw before and routes the same tokens;
2. per-channel clip-ratio search of the weight scales (algorithms.search_clip);
3. block-wise quantization with GPTQ error compensation (algorithms.gptq_quantize), else
   round to nearest.
`naive` is the baseline instead: one min-max scale per weight tensor and per activation
tensor, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.layers import LinearBase, RoutedExperts
from matrixinfer.quant.algorithms import gptq_quantize, search_alpha, search_clip, smooth_factors
from matrixinfer.quant.calibrate import InputStats
from matrixinfer.quant.int8 import quantize_symmetric, weight_scales
from matrixinfer.quant.w8a8 import W8A8Config, W8A8ExpertsMethod, W8A8LinearMethod


@dataclass
class QuantizeOptions:
    naive: bool = False  # per-tensor weights and activations, min-max: the baseline; ignores the rest
    smooth_alpha: float | str | None = "search"  # a float, "search" (per group) or None (off)
    scale_search: bool = True
    clip: str = "block"  # "block": GPTQ block-wise with error compensation; "none": round to nearest
    block_size: int = 128

    @property
    def act_strategy(self) -> str:
        return "tensor" if self.naive else "token"


def default_ignore(num_hidden_layers: int, num_mtp: int) -> list[str]:
    """What stays high precision: the LM head, kv_b_proj (absorbed, see w8a8.py), the router
    gate (vLLM and transformers see it as a Linear) and the MTP modules (not calibrated)."""
    ignore = ["lm_head", r"re:.*self_attn\.kv_b_proj$", r"re:.*mlp\.gate$"]
    ignore += [rf"re:model\.layers\.{num_hidden_layers + k}\..*" for k in range(num_mtp)]
    return ignore


def _smooth(stats: InputStats, weights: list[torch.Tensor], fold, alpha, opts_log: list, name: str,
            also: list[InputStats] = ()) -> None:
    """Smooth the input shared by `weights` ([O_k, I] views, scaled by s per column in place);
    fold(s) divides the producer of that input by s; `also`: other readers' statistics of
    the same input, rescaled with it."""
    if alpha == "search":
        alpha = search_alpha(weights, stats.sample(), stats.act_max)
    w_max = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)
    s = smooth_factors(stats.act_max, w_max, float(alpha))
    for w in weights:
        w.mul_(s.to(w.dtype))
    fold(s)
    for st in {id(x): x for x in (stats, *also)}.values():
        st.scaled(s)
    opts_log.append((name, float(alpha)))


@torch.no_grad()
def smooth_model(model: DeepseekForCausalLM, stats: dict, alpha, layers=None) -> list[tuple[str, float]]:
    """Apply SmoothQuant to the main decoder layers in place (layers: their indices, default
    all); returns (group, alpha) chosen."""
    log: list = []
    for i in range(len(model.model.layers)) if layers is None else layers:
        layer = model.model.layers[i]
        p = f"model.layers.{i}"
        attn = layer.self_attn

        def div(t, rows=None):
            return lambda s: t.div_(s.to(t.dtype)) if rows is None else t[rows].div_(s.to(t.dtype)[:, None])

        if attn.q_lora_rank is None:
            _smooth(stats[f"{p}.self_attn.q_proj"], [attn.q_proj.weight, attn.kv_a_proj_with_mqa.weight],
                    div(layer.input_layernorm.weight), alpha, log, f"{p}.input_layernorm",
                    [stats[f"{p}.self_attn.kv_a_proj_with_mqa"]])
        else:
            _smooth(stats[f"{p}.self_attn.fused_qkv_a_proj"], [attn.fused_qkv_a_proj.weight],
                    div(layer.input_layernorm.weight), alpha, log, f"{p}.input_layernorm")
            _smooth(stats[f"{p}.self_attn.q_b_proj"], [attn.q_b_proj.weight],
                    div(attn.q_a_layernorm.weight), alpha, log, f"{p}.q_a_layernorm")
        kv_b = attn.kv_b_proj.weight.view(attn.n_heads, attn.nope_dim + attn.v_dim, -1)

        def fold_v(s, kv_b=kv_b, attn=attn):  # o_proj's input is the heads' values
            kv_b[:, attn.nope_dim:].div_(s.view(attn.n_heads, attn.v_dim, 1).to(kv_b.dtype))
        _smooth(stats[f"{p}.self_attn.o_proj"], [attn.o_proj.weight], fold_v, alpha, log, f"{p}.kv_b_proj.v")
        mlps = []
        if hasattr(layer.mlp, "gate_up_proj"):  # dense
            _smooth(stats[f"{p}.mlp.gate_up_proj"], [layer.mlp.gate_up_proj.weight],
                    div(layer.post_attention_layernorm.weight), alpha, log, f"{p}.post_attention_layernorm")
            mlps.append((f"{p}.mlp", layer.mlp))
        else:
            _smooth_moe_input(layer, stats, p, alpha, log)
            if layer.mlp.shared_experts is not None:
                mlps.append((f"{p}.mlp.shared_experts", layer.mlp.shared_experts))
        for name, mlp in mlps:  # up rows -> down
            w = mlp.gate_up_proj.weight
            half = w.shape[0] // 2
            _smooth(stats[f"{name}.down_proj"], [mlp.down_proj.weight], div(w, slice(half, None)), alpha, log,
                    f"{name}.up_proj")
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            for e in range(len(experts.expert_ids)):
                st = stats[(f"{p}.mlp.experts", "w2", e)]
                if st.count:
                    w13 = experts.w13_weight[e]
                    _smooth(st, [experts.w2_weight[e]], div(w13, slice(w13.shape[0] // 2, None)), alpha, log,
                            f"{p}.mlp.experts.{e}.up_proj")
    return log


def _smooth_moe_input(layer, stats: dict, p: str, alpha, log: list) -> None:
    """post_attention_layernorm -> shared and routed experts' gate|up; the router gate's columns
    take s so that its logits are unchanged. The router's statistics (every token) stand for
    the input's."""
    moe, norm = layer.mlp, layer.post_attention_layernorm.weight
    weights, also = [], []
    if moe.shared_experts is not None:
        weights.append(moe.shared_experts.gate_up_proj.weight)
        also.append(stats[f"{p}.mlp.shared_experts.gate_up_proj"])
    experts = moe.experts
    for e in range(len(experts.expert_ids)):
        weights.append(experts.w13_weight[e])
        also.append(stats[(f"{p}.mlp.experts", "w13", e)])
    also = [st for st in also if st.count]

    def fold(s):
        norm.div_(s.to(norm.dtype))
        moe.gate.weight.mul_(s.to(moe.gate.weight.dtype))
    _smooth(stats[f"{p}.mlp.gate"], weights, fold, alpha, log, f"{p}.post_attention_layernorm", also)


def quantize_weight(w: torch.Tensor, stats: InputStats | None, opts: QuantizeOptions):
    """One float weight [O, I] -> (int8 [O, I], float32 scale [O, 1])."""
    w = w.detach().float()
    if opts.naive:
        scale = weight_scales(w, "tensor")
        return quantize_symmetric(w, scale), scale
    seen = stats is not None and stats.count > 0
    clip = search_clip(w, stats.sample()) if opts.scale_search and seen else 1.0
    scale = weight_scales(w, "channel", clip)
    if opts.clip == "block" and seen:
        return gptq_quantize(w, stats.hessian, scale, opts.block_size), scale
    return quantize_symmetric(w, scale), scale


@torch.no_grad()
def quantize_model(model: DeepseekForCausalLM, stats: dict, opts: QuantizeOptions,
                   ignore: list[str] | None = None, progress=None) -> tuple[DeepseekForCausalLM, list[str]]:
    """The W8A8 model of `model` (which is smoothed in place first if asked) and its ignore
    list. stats: from calibrate.collect_stats on this model."""
    cfg = model.config
    ignore = default_ignore(cfg.num_hidden_layers, len(model.model.mtp)) if ignore is None else ignore
    if opts.smooth_alpha is not None and not opts.naive:
        smooth_model(model, stats, opts.smooth_alpha)
    qcfg = W8A8Config(ignore, cfg.num_hidden_layers, opts.act_strategy)
    qmodel = DeepseekForCausalLM(cfg, None, len(model.model.mtp) > 0, qcfg).to(model.lm_head.weight.dtype)
    quantize_into(model, qmodel, stats, opts, progress)
    return qmodel.eval(), ignore


@torch.no_grad()
def quantize_into(src: torch.nn.Module, qmod_root: torch.nn.Module, stats: dict, opts: QuantizeOptions,
                  progress=None, prefix: str = "") -> None:
    """Fill qmod_root (built with the W8A8 config) from its float twin src: each W8A8 layer
    quantized (stats keyed by the full module name, prefix + its name in src), everything
    kept in float copied."""
    modules = dict(src.named_modules())
    for name, qmod in qmod_root.named_modules():
        method, full = getattr(qmod, "quant_method", None), f"{prefix}{name}"
        if isinstance(method, W8A8LinearMethod) and isinstance(qmod, LinearBase):
            q, s = quantize_weight(modules[name].weight, stats.get(full), opts)
            qmod.weight.copy_(q), qmod.weight_scale.copy_(s)
        elif isinstance(method, W8A8ExpertsMethod) and isinstance(qmod, RoutedExperts):
            for e in range(len(qmod.expert_ids)):
                for kind in ("w13", "w2"):
                    q, s = quantize_weight(getattr(modules[name], f"{kind}_weight")[e], stats.get((full, kind, e)), opts)
                    getattr(qmod, f"{kind}_weight")[e].copy_(q), getattr(qmod, f"{kind}_weight_scale")[e].copy_(s)
        else:
            continue
        if progress is not None:
            progress.update(1)
    floats = dict(src.named_parameters()) | dict(src.named_buffers())
    for name, t in list(qmod_root.named_parameters()) + list(qmod_root.named_buffers()):
        if t.dtype != torch.int8 and not name.endswith("_scale"):  # everything kept in float
            t.copy_(floats[name])


def num_quantized_modules(model: DeepseekForCausalLM, ignore: list[str]) -> int:
    """How many progress steps quantize_model takes (linear layers and expert sets quantized)."""
    qcfg = W8A8Config(ignore, model.config.num_hidden_layers)
    return sum(1 for name, m in model.named_modules()
               if isinstance(m, (LinearBase, RoutedExperts)) and not qcfg._float(name)
               and not name.endswith("kv_b_proj"))
