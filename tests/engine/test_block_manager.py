"""Block manager: prefix reuse by chained hashes with a namespace salt, reference counts, LRU."""

from matrixinfer.engine.block_manager import BlockManager
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.sequence import Sequence


def run_prefill(bm: BlockManager, tokens, namespace=""):
    seq = Sequence("r", 0, tokens, SamplingParams(), namespace)
    n = bm.allocate(seq, len(tokens))
    seq.num_computed_tokens += n
    bm.commit_full_blocks(seq)
    return seq, n


def test_shared_prefix_reuses_full_blocks():
    """A second prompt sharing 2 full blocks reuses them and computes only the rest."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a, _ = run_prefill(bm, list(range(10)))
    b, n = run_prefill(bm, list(range(8)) + [99, 98, 97])
    assert b.num_cached_tokens == 8 and n == 3
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_whole_prompt_hit_still_computes_last_token():
    """An identical prompt of whole blocks reuses all but the last block: one token must run to give logits."""
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, list(range(8)))
    b, n = run_prefill(bm, list(range(8)))
    assert b.num_cached_tokens == 4 and n == 4


def test_namespaces_never_share_blocks():
    """The same tokens in another namespace (tenant) are a miss."""
    bm = BlockManager(num_blocks=10, block_size=4)
    run_prefill(bm, list(range(10)), namespace="tenant-a")
    b, n = run_prefill(bm, list(range(10)), namespace="tenant-b")
    assert b.num_cached_tokens == 0 and n == 10
    c, _ = run_prefill(bm, list(range(10)), namespace="tenant-a")
    assert c.num_cached_tokens == 8


def test_freed_blocks_stay_cached_until_evicted_lru():
    """Freed blocks still hit; when space is needed the least recently freed go first."""
    bm = BlockManager(num_blocks=6, block_size=4)
    a, _ = run_prefill(bm, list(range(100, 108)) + [1])  # 3 blocks, 2 full
    bm.free_seq(a)
    b, _ = run_prefill(bm, list(range(200, 208)) + [1])
    bm.free_seq(b)
    assert bm.num_free_blocks == 6
    # needs 2 blocks: evicts from the LRU end, which is a's blocks (a's tail first)
    run_prefill(bm, [7, 7, 7, 7, 7])
    again_b, _ = run_prefill(bm, list(range(200, 208)) + [2])
    assert again_b.num_cached_tokens == 8
    assert bm.prefix_hits > 0 and bm.prefix_queries > bm.prefix_hits


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence("r", 0, list(range(12)), SamplingParams())
    assert bm.allocate(seq, 12) is None
    assert bm.num_free_blocks == 2 and seq.block_table == []
