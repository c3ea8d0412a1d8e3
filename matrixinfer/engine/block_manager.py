"""Paged latent KV cache bookkeeping: fixed-size blocks, reference counts, prefix reuse.

A full block is named by a chained hash of (namespace, all tokens up to and including the
block), so a hit means the whole prefix matches and tenants in different namespaces never
share. A hit is confirmed by comparing token ids. Freed blocks keep their contents and hash
and sit in an LRU queue: they are reused on a prefix hit, or evicted (oldest first) when a
new block is needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from matrixinfer.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int], namespace: str = "") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"ns:" + namespace.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict the cached contents
        block.hash, block.token_ids, block.ref_count = None, [], 1
        return block_id

    def _block_hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        hashes, parent, tokens = [], None, seq.all_token_ids
        for i in range(n_blocks):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size], seq.namespace)
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq. At least one token is left to compute, so
        that the step that finishes the prompt produces logits."""
        if not self.enable_prefix_caching:
            return []
        n_full = (len(seq) - 1) // self.block_size
        hits, tokens = [], seq.all_token_ids
        for i, h in enumerate(self._block_hashes(seq, n_full)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens[i * self.block_size:(i + 1) * self.block_size]:
                break
            hits.append(block_id)
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: int = 0) -> int:
        total = -(-(seq.num_computed_tokens + cached * self.block_size + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table) - cached)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Give seq the blocks for its next num_new_tokens (reusing cached prefix blocks on its
        first schedule). Returns how many tokens are left to compute this step (fewer after a
        prefix hit), or None, with nothing changed, if there are not enough free blocks."""
        hits = self.match_prefix(seq) if not seq.block_table else []
        if hits:
            num_new_tokens = min(num_new_tokens, len(seq) - len(hits) * self.block_size)
        # hits that sit in the free queue are taken from it, so they count against free blocks
        free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(seq, num_new_tokens, cached=len(hits))
        if needed + free_hits > len(self.free):
            return None
        if not seq.block_table and seq.num_computed_tokens == 0:
            self.prefix_queries += len(seq)
            self.prefix_hits += len(hits) * self.block_size
        for b in hits:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
            seq.block_table.append(b)
        if hits:
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
        for _ in range(needed):
            seq.block_table.append(self._take_free())
        return num_new_tokens

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that the last step filled, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        tokens, parent = seq.all_token_ids, None
        for i in range(n_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                parent = block.hash
                continue
            chunk = tokens[i * self.block_size:(i + 1) * self.block_size]
            parent = block_hash(parent, chunk, seq.namespace)
            block.hash, block.token_ids = parent, chunk
            self.hash_to_block.setdefault(parent, block.block_id)

    def free_seq(self, seq: Sequence) -> None:
        # Tail blocks first, so the shared prefix is the last to be evicted.
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None
        seq.block_table = []
