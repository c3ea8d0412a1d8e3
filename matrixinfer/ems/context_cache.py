"""Context cache: KV pages of a prompt prefix stored in EMS, addressed by a chained hash.

Page keys are the engine's block names (`matrixinfer.engine.block_hash`): page i of a token
sequence is keyed by h_i = H(h_{i-1} || tokens of page i), with h_{-1} = H(model id, KV dtype,
namespace). So a page key names its *whole* prefix, pages of different models or tenants
never collide, and a page an engine saved is found here under the same key. Only full pages
are cached (a partial page would change as the sequence grows).
"""

from __future__ import annotations

from matrixinfer.engine.block_hash import block_hashes, page_key, root_hash

from .client import EMSClient


class ContextCache:
    def __init__(self, client: EMSClient, model_id: str, page_tokens: int = 128, kv_dtype: str = ""):
        if not 1 <= page_tokens <= 4096:
            raise ValueError("page_tokens must be in 1..4096 (the paper uses 128-512)")
        self.client, self.model_id, self.page_tokens, self.kv_dtype = client, model_id, page_tokens, kv_dtype

    def page_keys(self, token_ids) -> list[str]:
        """Keys of the full pages of `token_ids`, in order."""
        root = root_hash(self.model_id, self.client.ns, self.kv_dtype)
        return [page_key(h) for h in block_hashes(token_ids, self.page_tokens, root)]

    def match_prefix(self, token_ids) -> int:
        """Number of leading full pages of `token_ids` present in the pool."""
        keys = self.page_keys(token_ids)
        n = 0
        for found in self.client.exists(keys) if keys else []:
            if not found:
                break
            n += 1
        return n

    def put_pages(self, token_ids, pages, start: int = 0) -> list[bool]:
        """Store pages[j] as page start+j of `token_ids` (bytes, arrays or CPU tensors)."""
        keys = self.page_keys(token_ids)
        if start + len(pages) > len(keys):
            raise ValueError(f"{start + len(pages)} pages given but token_ids has {len(keys)} full pages")
        return self.client.put_many(list(zip(keys[start : start + len(pages)], pages)))

    def get_pages(self, token_ids, n: int | None = None, start: int = 0) -> list[bytes | None]:
        """Pages start..start+n-1 (default: all full pages); None where a page is missing."""
        keys = self.page_keys(token_ids)
        keys = keys[start : len(keys) if n is None else start + n]
        return self.client.get_many(keys) if keys else []
