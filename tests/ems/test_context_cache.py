"""Context cache: chained page hashes, match_prefix, put_pages/get_pages."""

import torch

from matrixinfer.ems import ContextCache

PAGE = 128


def test_page_key_names_the_whole_prefix(pool, client_factory):
    """Equal page tokens after different prefixes get different keys; keys depend on model
    and namespace; only full pages get keys."""
    a = ContextCache(client_factory(pool, "ctx-a"), "model-x", PAGE)
    seq1 = list(range(3 * PAGE + 5))
    seq2 = [7] + seq1[1:]
    k1, k2 = a.page_keys(seq1), a.page_keys(seq2)
    assert len(k1) == 3 and k1[0] != k2[0] and k1[2] != k2[2]
    assert a.page_keys(seq1[: 2 * PAGE]) == k1[:2]
    other_model = ContextCache(a.client, "model-y", PAGE)
    other_ns = ContextCache(client_factory(pool, "ctx-b"), "model-x", PAGE)
    assert not set(k1) & set(other_model.page_keys(seq1))
    assert not set(k1) & set(other_ns.page_keys(seq1))


def test_match_prefix_counts_leading_pages_present(pool, client_factory):
    """After caching 3 pages of a prompt, a longer prompt with the same start matches 3;
    one that diverges inside page 2 matches 1; a gap stops the count."""
    cc = ContextCache(client_factory(pool, "ctx-m"), "m", PAGE)
    prompt = list(range(1000, 1000 + 3 * PAGE))
    assert cc.match_prefix(prompt) == 0
    assert cc.put_pages(prompt, [b"p0", b"p1", b"p2"]) == [True] * 3
    assert cc.match_prefix(prompt + list(range(5 * PAGE))) == 3
    diverged = prompt[: PAGE + 10] + [0] * (2 * PAGE)
    assert cc.match_prefix(diverged) == 1
    cc.client.delete(cc.page_keys(prompt)[1])
    assert cc.match_prefix(prompt) == 1


def test_put_pages_and_get_pages_roundtrip_kv_tensors(pool, client_factory):
    """KV pages stored as tensors come back byte-exact; missing pages are None; start/n slice."""
    cc = ContextCache(client_factory(pool, "ctx-kv"), "m", PAGE)
    tokens = list(range(4 * PAGE))
    pages = [torch.randn(PAGE, 576) for _ in range(3)]  # one layer's latent KV per page
    assert all(cc.put_pages(tokens, pages))
    got = cc.get_pages(tokens)
    assert got[3] is None
    assert all(torch.equal(torch.frombuffer(bytearray(g), dtype=torch.float32).view(PAGE, 576), p) for g, p in zip(got, pages))
    assert cc.get_pages(tokens, n=1, start=2)[0] == got[2]
