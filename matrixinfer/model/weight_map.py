"""Our parameter names <-> the checkpoint's per-projection names.

The model merges projections that read the same input (fused_qkv_a_proj = q_a_proj |
kv_a_proj_with_mqa, gate_up_proj = gate_proj | up_proj) and stacks the routed experts
(experts.w13_weight = every expert's gate_proj | up_proj, experts.w2_weight = every down_proj);
checkpoints keep one tensor per projection and expert. The loader maps each checkpoint name to
(parameter, shard_id) for that parameter's weight_loader; the saver splits the parameters back.
MTP layers are named model.mtp.{k}.* here; the loader and saver translate those themselves.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import nn

from matrixinfer.model.layers import LinearBase, RoutedExperts
from matrixinfer.model.layers.experts import PIECES

# merged module name -> the checkpoint's module names of its pieces, in order (shard_id = index)
MERGED = {"fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "gate_up_proj": ("gate_proj", "up_proj")}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")

ShardId = int | tuple[int, str] | None


def param_for(name: str, params: dict[str, torch.Tensor]) -> tuple[str, ShardId]:
    """Checkpoint tensor name -> (our parameter name, shard_id for its weight_loader)."""
    m = _EXPERT.match(name)
    if m:
        prefix, expert, piece, suffix = m.groups()
        return f"{prefix}.{'w2' if piece == 'down_proj' else 'w13'}_{suffix}", (int(expert), piece)
    module, _, suffix = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for merged, pieces in MERGED.items():
        target = f"{parent}.{merged}.{suffix}"
        if leaf in pieces and target in params:  # kv_a_proj_with_mqa is unmerged without q_lora
            return target, pieces.index(leaf)
    return name, None


def checkpoint_names(prefix: str, num_hidden_layers: int) -> list[str]:
    """Our module prefix -> the checkpoint's module name(s): merged layers have one per piece,
    MTP module k is layer num_hidden_layers + k, the experts are named by expert 0."""
    m = re.match(r"model\.mtp\.(\d+)\.(.*)", prefix)
    if m:
        prefix = f"model.layers.{num_hidden_layers + int(m.group(1))}.{m.group(2)}"
    parent, _, leaf = prefix.rpartition(".")
    if leaf in MERGED:
        return [f"{parent}.{piece}" for piece in MERGED[leaf]]
    if leaf == "experts":
        return [f"{prefix}.0.{piece}" for piece in PIECES]
    return [prefix]


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the checkpoint holds for this model, under its checkpoint name: views into
    the merged and stacked parameters (this rank's shard of them under tensor parallelism).
    Rotary frequencies and a head tied to the embedding are not in checkpoints."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for mod_name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for pname, t in tensors:
            name = f"{mod_name}.{pname}" if mod_name else pname
            if pname == "inv_freq" or (tied and name == "lm_head.weight"):
                continue
            if isinstance(module, RoutedExperts):
                stacked, suffix = pname.split("_", 1)  # w13 | w2, weight (or a quant method's scale)
                for slot, expert in enumerate(module.expert_ids):
                    if stacked == "w2":
                        yield f"{mod_name}.{expert}.down_proj.{suffix}", t[slot]
                    else:
                        gate, up = t[slot].chunk(2, dim=t.output_dim - 1)
                        yield f"{mod_name}.{expert}.{PIECES[0]}.{suffix}", gate
                        yield f"{mod_name}.{expert}.{PIECES[1]}.{suffix}", up
            elif isinstance(module, LinearBase) and len(module.output_sizes) > 1 and hasattr(t, "output_dim"):
                parent, _, leaf = mod_name.rpartition(".")
                # a parameter of other rows than the weight's (FP8 block scales) says how it splits
                parts = t.split(getattr(t, "output_split", module.output_partition_sizes), dim=t.output_dim)
                for piece, part in zip(MERGED[leaf], parts):
                    yield f"{parent}.{piece}.{pname}", part
            else:
                yield name, t
