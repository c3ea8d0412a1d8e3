"""One deployment description for `matrixinfer serve --deployment` and `matrixinfer simulate deployment`.

A YAML file (every key optional unless marked required):

    model: models/matrixinfer-tiny-moe   # required: a model directory or an HF config.json
    dtype: bfloat16                      # float32 | bfloat16 | int8 (weights)
    colocated: false                     # true: one kind of instance runs prefill and decode
                                         #       (describe it under `decode:`; no `prefill:`)
    prefill:                             # PDC only
      instances: 6
      tensor_parallel_size: 1
      expert_parallel_size: 32
      prefill_parallel: sp-tp-sp         # dp | tp | sp-tp-sp (attention across the instance)
    decode:
      instances: 1
      tensor_parallel_size: 1
      expert_parallel_size: 320
      dispatch_dtype: int8               # int8 | fp8 | bf16 (tokens on the wire)
      speculative_num_tokens: 1          # MTP draft tokens per step (0 = off)
      num_redundant_experts: 32          # extra copies of hot experts (EPLB)
      eplb_interval: 0                   # decode steps between EPLB rebalances (0 = placed once)
      microbatches: 2                    # 1 | 2: attention of one overlaps the MoE of the other
      shared_expert_placement: replicated  # replicated | dedicated (shared experts on ranks of their own)
    ems:
      servers: 0                         # EMS (context + model cache) servers, 0 = none
      replicas: 1                        # copies of each KV / model-cache object on distinct servers

An instance occupies max(tensor_parallel_size, expert_parallel_size) devices. Errors are
ValueError naming the file and the field. Nothing here imports the simulator or the engine:
`EngineConfig.for_roles` (config.py) turns each role's section into the engine configuration
its instances run, `matrixinfer simulate deployment` predicts the same file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

DTYPES = ("float32", "bfloat16", "int8")
PREFILL_PARALLEL = ("dp", "tp", "sp-tp-sp")
DISPATCH_DTYPES = ("int8", "fp8", "bf16")
SHARED_EXPERT_PLACEMENTS = ("replicated", "dedicated")
ZERO_OK = ("speculative_num_tokens", "num_redundant_experts", "eplb_interval")  # integer fields that may be 0


@dataclass(frozen=True)
class PrefillRole:
    instances: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    prefill_parallel: str = "dp"

    @property
    def devices(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)


@dataclass(frozen=True)
class DecodeRole:
    instances: int = 1
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    dispatch_dtype: str = "bf16"
    speculative_num_tokens: int = 0
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    microbatches: int = 1
    shared_expert_placement: str = "replicated"

    @property
    def devices(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)


@dataclass(frozen=True)
class Deployment:
    model: str
    dtype: str = "bfloat16"
    colocated: bool = True
    prefill: PrefillRole | None = None
    decode: DecodeRole = field(default_factory=DecodeRole)
    ems_servers: int = 0
    batch_invariant: bool = False  # every role in model/batch_invariant.py's mode
    ems_replicas: int = 1

    @property
    def devices(self) -> int:
        pre = self.prefill.instances * self.prefill.devices if self.prefill else 0
        return pre + self.decode.instances * self.decode.devices


def _err(where: str, key: str, msg: str) -> ValueError:
    return ValueError(f"{where}: {key}: {msg}")


def _section(raw: dict, cls, where: str, prefix: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise _err(where, prefix, f"expected a mapping, got {raw!r}")
    known = cls.__dataclass_fields__
    for k in raw:
        if k not in known:
            raise _err(where, f"{prefix}.{k}", f"unknown field (known: {', '.join(known)})")
    vals = {}
    for k, f in known.items():
        v = raw.get(k, f.default)
        key = f"{prefix}.{k}"
        if f.type == "int":
            ok_min = 0 if k in ZERO_OK else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < ok_min:
                raise _err(where, key, f"must be an integer >= {ok_min}, got {v!r}")
        vals[k] = v
    if "prefill_parallel" in vals and vals["prefill_parallel"] not in PREFILL_PARALLEL:
        raise _err(where, f"{prefix}.prefill_parallel", f"must be one of {PREFILL_PARALLEL}, got {vals['prefill_parallel']!r}")
    if "dispatch_dtype" in vals and vals["dispatch_dtype"] not in DISPATCH_DTYPES:
        raise _err(where, f"{prefix}.dispatch_dtype", f"must be one of {DISPATCH_DTYPES}, got {vals['dispatch_dtype']!r}")
    if vals.get("microbatches", 1) > 2:
        raise _err(where, f"{prefix}.microbatches", f"must be 1 or 2, got {vals['microbatches']!r}")
    if "shared_expert_placement" in vals and vals["shared_expert_placement"] not in SHARED_EXPERT_PLACEMENTS:
        raise _err(where, f"{prefix}.shared_expert_placement",
                   f"must be one of {SHARED_EXPERT_PLACEMENTS}, got {vals['shared_expert_placement']!r}")
    return cls(**vals)


def deployment_from_dict(raw: dict, where: str = "<deployment>") -> Deployment:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a YAML mapping at the top level")
    known = {"model", "dtype", "colocated", "prefill", "decode", "ems", "batch_invariant"}
    for k in raw:
        if k not in known:
            raise _err(where, k, f"unknown field (known: {', '.join(sorted(known))})")
    if not raw.get("model"):
        raise _err(where, "model", "required: a model directory or an HF config.json")
    dtype = raw.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        raise _err(where, "dtype", f"must be one of {DTYPES}, got {dtype!r}")
    colocated = raw.get("colocated", "prefill" not in raw)
    if not isinstance(colocated, bool):
        raise _err(where, "colocated", f"must be true or false, got {colocated!r}")
    if colocated and raw.get("prefill") is not None:
        raise _err(where, "prefill", "a colocated deployment has no prefill role (describe its instances under decode)")
    if not colocated and raw.get("prefill") is None:
        raise _err(where, "prefill", "required when colocated is false")
    invariant = raw.get("batch_invariant", False)
    if not isinstance(invariant, bool):
        raise _err(where, "batch_invariant", f"must be true or false, got {invariant!r}")
    ems = raw.get("ems") or {}
    unknown = sorted(set(ems) - {"servers", "replicas"}) if isinstance(ems, dict) else []
    if unknown:
        raise _err(where, f"ems.{unknown[0]}", "unknown field (known: servers, replicas)")
    servers = ems.get("servers", 0) if isinstance(ems, dict) else ems
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 0:
        raise _err(where, "ems.servers", f"must be an integer >= 0, got {servers!r}")
    replicas = ems.get("replicas", 1) if isinstance(ems, dict) else 1
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise _err(where, "ems.replicas", f"must be an integer >= 1, got {replicas!r}")
    return Deployment(model=str(raw["model"]), dtype=dtype, colocated=colocated,
                      prefill=None if colocated else _section(raw["prefill"], PrefillRole, where, "prefill"),
                      decode=_section(raw.get("decode"), DecodeRole, where, "decode"), ems_servers=servers,
                      batch_invariant=invariant, ems_replicas=replicas)


def load_deployment(path: str | Path) -> Deployment:
    """Read and validate a deployment YAML; a relative `model` is resolved against the file's folder
    when it exists there, else kept as given (relative to the working directory)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no deployment file {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    dep = deployment_from_dict(raw, str(path))
    beside = path.parent / dep.model
    if not Path(dep.model).is_absolute() and not Path(dep.model).exists() and beside.exists():
        from dataclasses import replace

        dep = replace(dep, model=str(beside))
    return dep
