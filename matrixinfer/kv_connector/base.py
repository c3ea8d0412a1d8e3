"""The KV connector: how KV blocks enter and leave an engine instance (the Caching side of
P/D/C), split as in vLLM v1 into a scheduler half (what to load, what to save, when blocks
may be freed) and a worker half (moving bytes between the KV cache and elsewhere), so no
transfer logic sits in the model.

Scheduler half, called by engine/scheduler.py:
  get_num_new_matched_tokens(req, num_computed_tokens) -> int   no side effects; may repeat
  update_state_after_alloc(req, num_local_tokens, num_external_tokens)
  build_connector_meta(scheduler_output, requests) -> metadata shipped to every worker
  request_finished(req) -> bool      True: keep its blocks until a transfer ends
Worker half, called by worker/worker.py around the forward:
  register_kv_cache(kv_cache)
  start_load_kv(metadata)            blocks whose load failed are reported by get_failed_loads
  wait_for_layer_load(layer_idx)     loads here are whole-block and finish in start_load_kv
  save_kv_layer(layer_idx)           saves here are whole-block, done in wait_for_save
  wait_for_save()
  get_finished() -> (finished sending ids, finished receiving ids)  for asynchronous transfers
  get_failed_loads() -> request ids whose tokens must be recomputed (never a failed request)
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int: ...

    @abstractmethod
    def update_state_after_alloc(self, req, num_local_tokens: int, num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output, requests: list) -> object: ...

    def request_finished(self, req) -> bool:
        return False


class KVConnectorWorker(ABC):
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache  # [layers, blocks, block_size, dim]

    @abstractmethod
    def start_load_kv(self, metadata) -> None: ...

    def wait_for_layer_load(self, layer_idx: int) -> None:
        return None

    def save_kv_layer(self, layer_idx: int) -> None:
        return None

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def keep_saves(self, blocks: set[int]) -> None:
        """Attention data parallelism (expert parallelism): this rank wrote only `blocks` this
        step, so it saves only those; called between the forward and wait_for_save."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()

    @abstractmethod
    def get_failed_loads(self) -> set[str]: ...
