"""The compressed-tensors W8A8 int8 layout (what llm-compressor writes and vLLM reads):
config.json carries

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "int-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"],
          "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false},
          "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token",
                                "dynamic": true}}},
      "ignore": ["lm_head", "re:.*mlp.gate$", ...]}

and each quantized projection `<module>.weight` is int8 [O, I] beside `<module>.weight_scale`
[O, 1] (per tensor: [1]); dynamic activations store no `input_scale`. Symmetric zero points,
when a writer stores them, are all zero and skipped by the loader.
"""

from __future__ import annotations

from matrixinfer.quant.w8a8 import W8A8Config

QUANT_METHOD = "compressed-tensors"


def _int8(args: dict | None, what: str) -> dict:
    if not args:
        raise ValueError(f"compressed-tensors: {what} must be quantized (W8A8)")
    if args.get("num_bits") != 8 or args.get("type", "int") != "int" or not args.get("symmetric", True):
        raise ValueError(f"compressed-tensors: only symmetric 8-bit int {what} are supported, got {args}")
    return args


def config_from_dict(qcfg: dict, num_hidden_layers: int = 0) -> W8A8Config:
    """config.json's quantization_config -> the W8A8 method, or a clear error for a scheme this
    engine does not run (FP8, int4, group/block strategies, static activation scales)."""
    if qcfg.get("quant_method") not in (QUANT_METHOD, "w8a8"):
        raise ValueError(f"unsupported quantization method {qcfg.get('quant_method')!r} (supported: compressed-tensors "
                         "W8A8 int8)")
    if qcfg.get("format", "int-quantized") != "int-quantized":
        raise ValueError(f"compressed-tensors format {qcfg.get('format')!r}: only int-quantized is supported")
    groups = list((qcfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: expected one config group, got {len(groups)}")
    group = groups[0]
    if "Linear" not in group.get("targets", []):
        raise ValueError(f"compressed-tensors: the group must target Linear, got {group.get('targets')}")
    w = _int8(group.get("weights"), "weights")
    if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic"):
        raise ValueError(f"compressed-tensors: weights need a static channel or tensor strategy, got {w}")
    a = _int8(group.get("input_activations"), "input activations")
    if not a.get("dynamic") or a.get("strategy") not in ("token", "tensor"):
        raise ValueError(f"compressed-tensors: activations must be dynamic per token (or per tensor), got {a}")
    return W8A8Config(qcfg.get("ignore"), num_hidden_layers, act_strategy=a["strategy"])


def config_to_dict(ignore: list[str], weight_strategy: str = "channel", act_strategy: str = "token") -> dict:
    """The quantization_config our quantizer writes."""
    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None,
                "observer": None if dynamic else "minmax", "observer_kwargs": {}}
    return {
        "quant_method": QUANT_METHOD, "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args(weight_strategy, False),
                                      "input_activations": args(act_strategy, True), "output_activations": None}},
        "ignore": list(ignore), "kv_cache_scheme": None,
    }
