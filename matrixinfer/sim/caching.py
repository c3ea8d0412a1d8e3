"""EMS (the Caching pool) cost terms: context cache for prefill and model cache for loading.

Context cache: a fraction of each prompt is found as KV pages in EMS; the prefill model
(prefill.py) skips their compute and reads their latent KV over UB or VPC.
Model cache: N instances load the same checkpoint. Direct: every instance reads the whole
checkpoint from object storage, sharing its bandwidth. Through EMS: the checkpoint is read
once into the pool, then every instance reads it from the pool in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec
from matrixinfer.sim.prefill import PrefillConfig, prefill_batch


@dataclass(frozen=True)
class ContextCacheResult:
    hit: float
    plane: str
    prefill_throughput_ratio: float  # tokens/s with cache over tokens/s without
    ttft_reduction: float  # 1 - TTFT with cache / TTFT without
    kv_load_s: float


def context_cache(hw: HardwareSpec, model: ModelSpec, hit: float, plane: str = "ub",
                  cfg: PrefillConfig | None = None) -> ContextCacheResult:
    base_cfg = cfg or PrefillConfig()
    base = prefill_batch(hw, model, replace(base_cfg, cache_hit=0.0))
    cached = prefill_batch(hw, model, replace(base_cfg, cache_hit=hit, page_plane=plane))
    return ContextCacheResult(hit, plane, cached.tokens_per_s_per_device / base.tokens_per_s_per_device,
                              1.0 - cached.ttft_s / base.ttft_s, cached.kv_load_s)


@dataclass(frozen=True)
class ModelCacheResult:
    direct_s: float
    ems_s: float
    pool_read_gb_s: float


def model_cache(hw: HardwareSpec, size_gb: float, instances: int, obs_gb_s: float,
                instance_devices: int = 32) -> ModelCacheResult:
    """Time until all `instances` hold the checkpoint.

    direct: instances * size / obs  (they share the object store's bandwidth)
    ems:    size / obs  (one read into the pool)  +  instances * size / pool read bandwidth,
            where pool read bandwidth = min(readers' UB bandwidth, EMS sockets' memory bandwidth).
    """
    if size_gb <= 0 or instances < 1 or obs_gb_s <= 0:
        raise ValueError("size_gb, instances and obs_gb_s must be positive")
    eff = hw.efficiency.link
    readers = instances * instance_devices * hw.scale_up.gb_s * eff
    pool = hw.cpu_sockets * hw.cpu_mem_gb_s * eff if hw.cpu_sockets else readers
    read_bw = min(readers, pool)
    return ModelCacheResult(instances * size_gb / obs_gb_s, size_gb / obs_gb_s + instances * size_gb / read_bw, read_bw)
