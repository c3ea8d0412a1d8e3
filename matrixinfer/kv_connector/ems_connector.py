"""The EMS connector: full latent KV blocks go to the Elastic Memory Service pool under their
block name (`engine/block_hash.py`), and come back from it when any instance sees the same
prefix.

One EMS object per block holds the block for every layer ([layers, block_size, latent dim] in
the cache dtype): a prefix hit needs one lookup per block, not one per layer and block.
Loads and saves are synchronous around the forward: loads before it (the step's attention
needs them), saves after it, of the blocks the step filled. A load that fails (server killed,
page evicted, wrong size) makes its request recompute those tokens.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from matrixinfer.config import KVTransferConfig
from matrixinfer.engine.block_hash import page_key
from matrixinfer.kv_connector.base import KVConnectorScheduler, KVConnectorWorker

log = logging.getLogger(__name__)


@dataclass
class EMSConnectorMetadata:
    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # request id -> (block id, key)
    saves: list[tuple[int, str]] = field(default_factory=list)  # (block id, key) filled by this step


def _client(cfg: KVTransferConfig):
    from matrixinfer.ems.client import EMSClient

    return EMSClient(cfg.ems_controller, namespace=cfg.ems_namespace, timeout_s=cfg.ems_timeout_s)


class EMSConnectorScheduler(KVConnectorScheduler):
    def __init__(self, cfg: KVTransferConfig, kv_manager, client=None):
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.client = client if client is not None else _client(cfg)
        self._matched: dict[str, int] = {}  # request id -> matched tokens (lookups are network calls)
        self._pending: dict[str, list[tuple[int, str]]] = {}
        self._saved: OrderedDict[str, None] = OrderedDict()  # recently saved keys, not saved again
        self._next_block: dict[str, int] = {}  # request id -> the first block its last step left incomplete

    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> int:
        if req.request_id in self._matched:
            return self._matched[req.request_id]
        first = num_computed_tokens // self.block_size
        n_full = (req.num_tokens - 1) // self.block_size  # leave one token to compute
        keys = [page_key(h) for h in self.kv.request_block_hashes(req, n_full)[first:]]
        n = 0
        try:
            for found in self.client.exists(keys) if keys else []:
                if not found:
                    break
                n += 1
        except Exception as e:  # the pool is a cache: an error is a miss, never a failed request
            log.warning("EMS lookup failed (%s); computing the prefix instead", e)
            n = 0
        self._matched[req.request_id] = n * self.block_size
        return n * self.block_size

    def update_state_after_alloc(self, req, num_local_tokens: int, num_external_tokens: int) -> None:
        self._matched.pop(req.request_id, None)
        first, n = num_local_tokens // self.block_size, num_external_tokens // self.block_size
        hashes = self.kv.request_block_hashes(req, first + n)
        self._pending[req.request_id] = [(req.block_table[i], page_key(hashes[i])) for i in range(first, first + n)]

    def build_connector_meta(self, scheduler_output, requests: list) -> EMSConnectorMetadata:
        meta = EMSConnectorMetadata(loads=self._pending)
        self._pending = {}
        loaded = {key for pages in meta.loads.values() for _, key in pages}
        for s, req in zip(scheduler_output.requests, requests):
            end = s.start_pos + len(s.token_ids) - s.num_draft  # drafts are not KV until accepted
            # blocks completed since this request's last step: this step's, and those that the
            # last step's accepted drafts or multi-step decode tokens completed (saved once: _saved)
            first = min(self._next_block.get(s.request_id, s.start_pos // self.block_size),
                        s.start_pos // self.block_size)
            self._next_block[s.request_id] = end // self.block_size
            full = range(first, end // self.block_size)
            if not full:
                continue
            hashes = self.kv.request_block_hashes(req, full.stop)
            for i in full:
                key = page_key(hashes[i])
                if key in loaded:
                    continue
                if key in self._saved:
                    self._saved.move_to_end(key)
                    continue
                self._saved[key] = None
                meta.saves.append((s.block_table[i], key))
        while len(self._saved) > 65536:
            self._saved.popitem(last=False)
        return meta

    def request_finished(self, req) -> bool:
        self._matched.pop(req.request_id, None)
        self._next_block.pop(req.request_id, None)
        self._pending.pop(req.request_id, None)
        return False


class EMSConnectorWorker(KVConnectorWorker):
    def __init__(self, cfg: KVTransferConfig, saves: bool = True, client=None):
        self.client = client if client is not None else _client(cfg)
        # with tensor parallelism every rank holds the same latent: one (TP rank 0) saves; under
        # attention data parallelism each replica's TP rank 0 saves the blocks of its own requests
        self.saves_enabled = saves
        self._failed: set[str] = set()
        self._to_save: list[tuple[int, str]] = []

    def start_load_kv(self, metadata: EMSConnectorMetadata) -> None:
        self._failed = set()
        self._to_save = metadata.saves if self.saves_enabled else []
        items = [(rid, b, k) for rid, pages in metadata.loads.items() for b, k in pages]
        if not items:
            return
        cache = self.kv_cache
        page_shape = (cache.shape[0], cache.shape[2], cache.shape[3])
        nbytes = cache.shape[0] * cache.shape[2] * cache.shape[3] * cache.dtype.itemsize
        try:
            values = self.client.get_many([k for _, _, k in items])
        except Exception as e:
            log.warning("EMS load failed (%s); recomputing", e)
            values = [None] * len(items)
        for (rid, block, _), value in zip(items, values):
            if value is None or len(value) != nbytes:
                self._failed.add(rid)
                continue
            page = torch.frombuffer(bytearray(value), dtype=torch.uint8).view(cache.dtype).view(page_shape)
            cache[:, block].copy_(page)

    def keep_saves(self, blocks: set[int]) -> None:
        self._to_save = [(b, key) for b, key in self._to_save if b in blocks]

    def wait_for_save(self) -> None:
        if not self._to_save:
            return
        cache = self.kv_cache
        pages = [(key, cache[:, block].contiguous()) for block, key in self._to_save]
        self._to_save = []
        try:
            self.client.put_many(pages)
        except Exception as e:  # a lost save is a later miss, not an error
            log.warning("EMS save failed (%s)", e)

    def get_failed_loads(self) -> set[str]:
        return self._failed
