"""KV cache manager: prefix reuse by chained block names salted by namespace, reference
counts, LRU; and the one block name shared with EMS."""

from matrixinfer.engine.block_hash import block_hashes, page_key, root_hash
from matrixinfer.engine.kv_cache_manager import KVCacheManager
from matrixinfer.engine.request import Request
from matrixinfer.engine.sampling_params import SamplingParams


def run_prefill(kv: KVCacheManager, tokens, namespace=""):
    req = Request("r", tokens, SamplingParams(), namespace)
    blocks, n_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(tokens) - n_cached, blocks)
    req.num_cached_tokens = req.num_computed_tokens = n_cached
    req.num_computed_tokens += len(tokens) - n_cached
    kv.cache_full_blocks(req)
    return req, len(tokens) - n_cached


def test_shared_prefix_reuses_full_blocks():
    """A second prompt sharing 2 full blocks reuses them and computes only the rest."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a, _ = run_prefill(kv, list(range(10)))
    b, n = run_prefill(kv, list(range(8)) + [99, 98, 97])
    assert b.num_cached_tokens == 8 and n == 3
    assert b.block_table[:2] == a.block_table[:2]
    assert kv.blocks[a.block_table[0]].ref_count == 2


def test_whole_prompt_hit_still_computes_last_token():
    """An identical prompt of whole blocks reuses all but the last block: one token must run to give logits."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, list(range(8)))
    b, n = run_prefill(kv, list(range(8)))
    assert b.num_cached_tokens == 4 and n == 4


def test_namespaces_and_models_never_share_blocks():
    """The same tokens in another namespace (tenant) or of another model are a miss."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, list(range(10)), namespace="tenant-a")
    b, n = run_prefill(kv, list(range(10)), namespace="tenant-b")
    assert b.num_cached_tokens == 0 and n == 10
    c, _ = run_prefill(kv, list(range(10)), namespace="tenant-a")
    assert c.num_cached_tokens == 8
    other = KVCacheManager(num_blocks=10, block_size=4, model_id="other-model")
    assert other.request_block_hashes(Request("x", list(range(10)), SamplingParams(), "tenant-a"), 2) != c.block_hashes[:2]


def test_freed_blocks_stay_cached_until_evicted_lru():
    """Freed blocks still hit; when space is needed the least recently freed go first."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, _ = run_prefill(kv, list(range(100, 108)) + [1])  # 3 blocks, 2 full
    kv.free(a)
    b, _ = run_prefill(kv, list(range(200, 208)) + [1])
    kv.free(b)
    assert kv.num_free_blocks == 6
    # needs 2 blocks: evicts from the LRU end, which is a's blocks (a's tail first)
    run_prefill(kv, [7, 7, 7, 7, 7])
    again_b, _ = run_prefill(kv, list(range(200, 208)) + [2])
    assert again_b.num_cached_tokens == 8
    assert kv.prefix_hits > 0 and kv.prefix_queries > kv.prefix_hits


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = Request("r", list(range(12)), SamplingParams())
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and req.block_table == []


def test_external_tokens_get_blocks_but_no_compute():
    """Tokens a connector loads take blocks like computed ones."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = Request("r", list(range(11)), SamplingParams())
    assert kv.allocate_slots(req, 3, [], num_external_tokens=8)
    assert len(req.block_table) == 3


def test_engine_block_names_are_the_ems_page_keys():
    """The engine's name of a block is the key its page has in EMS: one function, both sides."""
    from matrixinfer.ems.context_cache import ContextCache

    kv = KVCacheManager(num_blocks=10, block_size=4, model_id="m", kv_dtype="bfloat16")
    req, _ = run_prefill(kv, list(range(13)), namespace="t")

    class Client:
        ns = "t"

    cc = ContextCache(Client(), "m", page_tokens=4, kv_dtype="bfloat16")
    assert cc.page_keys(list(range(13))) == [page_key(h) for h in req.block_hashes[:3]]
    assert req.block_hashes[:3] == block_hashes(list(range(13)), 4, root_hash("m", "t", "bfloat16"))
