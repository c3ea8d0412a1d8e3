"""Paged latent KV cache bookkeeping: fixed-size blocks, reference counts, prefix reuse.

A full block is named by `block_hash.block_hashes` (model identity + KV dtype + namespace +
every token up to the end of the block), the same name EMS stores its page under. A local hit
is confirmed by comparing token ids. Freed blocks keep their contents and name in an LRU
queue: reused on a prefix hit, evicted oldest first when a new block is needed.

Operations, as the scheduler uses them:
  get_computed_blocks(req)  -> cached prefix blocks (no side effects)
  allocate_slots(req, n, computed_blocks, num_external_tokens) -> bool (all or nothing)
  cache_full_blocks(req)    -> name blocks the last step filled
  free(req)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from matrixinfer.engine.block_hash import block_hashes, root_hash
from matrixinfer.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model_id: str = "", kv_dtype: str = ""):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id, self.kv_dtype = model_id, kv_dtype
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self._roots: dict[str, bytes] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    # -- names ------------------------------------------------------------------------------------
    def request_block_hashes(self, req: Request, n_blocks: int) -> list[bytes]:
        """Names of req's first n_blocks full blocks, computed once each and kept on the request."""
        have = len(req.block_hashes)
        if n_blocks > have:
            root = self._roots.get(req.namespace)
            if root is None:
                root = self._roots[req.namespace] = root_hash(self.model_id, req.namespace, self.kv_dtype)
            tokens = req.all_token_ids[: n_blocks * self.block_size]
            req.block_hashes += block_hashes(tokens, self.block_size, root, have, req.block_hashes[-1] if have else None)
        return req.block_hashes[:n_blocks]

    # -- operations -------------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Locally cached blocks holding a prefix of req, and the tokens they cover. At least one
        token is left to compute, so that the step finishing the prompt produces logits."""
        if not self.enable_prefix_caching or req.block_table:
            return [], 0
        n_full = (req.num_tokens - 1) // self.block_size
        hits, tokens = [], req.all_token_ids
        for i, h in enumerate(self.request_block_hashes(req, n_full)):
            b = self.hash_to_block.get(h)
            if b is None or self.blocks[b].token_ids != tokens[i * self.block_size:(i + 1) * self.block_size]:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None,
                       num_external_tokens: int = 0) -> bool:
        """Blocks for req's next num_new_tokens, after its locally cached computed_blocks (taken on
        its first allocation) and num_external_tokens whose KV a connector will write. False,
        with nothing changed, when there are not enough free blocks."""
        if not computed_blocks and not num_external_tokens and req.num_cached_tokens >= 0:
            # the common decode step: the new tokens fit the blocks it holds
            if req.num_computed_tokens + num_new_tokens <= len(req.block_table) * self.block_size:
                return True
        computed_blocks = computed_blocks or []
        free_hits = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)  # hits still in the queue
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_external_tokens + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(req.block_table) - len(computed_blocks))
        if needed + free_hits > len(self.free_queue):
            return False
        if req.num_cached_tokens < 0:  # its first allocation: count the prefix-cache lookup
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1
            req.block_table.append(b)
        for _ in range(needed):
            req.block_table.append(self._take_free())
        return True

    def cache_full_blocks(self, req: Request) -> list[tuple[int, bytes]]:
        """Name the blocks the last step filled (for later prefix hits). Returns the newly named
        (block id, name) pairs: what a connector saves."""
        if not self.enable_prefix_caching:
            return []
        n_full = req.num_computed_tokens // self.block_size
        # blocks are named in order, so a named last full block means nothing new: the common
        # decode step returns here without touching the token list
        if n_full == 0 or self.blocks[req.block_table[n_full - 1]].hash is not None:
            return []
        names = self.request_block_hashes(req, n_full)
        tokens, new = req.all_token_ids, []
        for i in range(n_full):
            block = self.blocks[req.block_table[i]]
            if block.hash is not None:
                continue
            block.hash, block.token_ids = names[i], tokens[i * self.block_size:(i + 1) * self.block_size]
            if self.hash_to_block.setdefault(names[i], block.block_id) == block.block_id:
                new.append((block.block_id, names[i]))
        return new

    def free(self, req: Request) -> None:
        # Tail blocks first, so the shared prefix is the last to be evicted.
        for b in reversed(req.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[b] = None
        req.block_table = []

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict the cached contents
        block.hash, block.token_ids, block.ref_count = None, [], 1
        return block_id
