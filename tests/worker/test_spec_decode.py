"""The worker half of MTP speculation: rejection sampling keeps the target's distribution
exactly, greedy verification accepts the longest matching prefix, and a speculative step reads
the device once (verify -> accept -> draft run without a host round trip)."""

from contextlib import contextmanager

import pytest
import torch

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from matrixinfer.model.loader import load_model
from matrixinfer.worker.model_runner import ModelRunner
from matrixinfer.worker.sampler import filter_logits
from matrixinfer.worker.spec_decode import SpecBatch, verify


def spec_rows(n: int, drafts: list[int], params: SamplingParams) -> list[ScheduledRequest]:
    """n decode rows, each the token 0 then `drafts`, at position 10."""
    return [ScheduledRequest(f"r{i}", [0] + drafts, 10, [0], True, params, num_draft=len(drafts), spec=True)
            for i in range(n)]


def test_greedy_verification_accepts_the_longest_matching_prefix():
    # target argmax per row: 3, 1, 4
    logits = torch.full((6, 5), -1.0)
    for row, tok in enumerate([3, 1, 4, 3, 1, 4]):
        logits[row, tok] = 1.0
    reqs = [ScheduledRequest("a", [0, 3, 2], 0, [0], True, SamplingParams(temperature=0), num_draft=2, spec=True),
            ScheduledRequest("b", [0, 3, 1], 0, [0], True, SamplingParams(temperature=0), num_draft=2, spec=True)]
    b = SpecBatch.build(reqs, 5, torch.device("cpu"), lambda r: None)
    tokens, accepted = verify(logits, b)
    assert accepted.tolist() == [1, 2]
    assert tokens[:2].tolist() == [3, 1] and tokens[3:].tolist() == [3, 1, 4]  # request a: 3 accepted, then 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.8)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """20,000 trials of two drafts over a 6-token vocabulary: the first token is distributed as the
    target's p_0, the second (given the first draft accepted) as p_1, the third as p_2."""
    torch.manual_seed(0)
    n, v, drafts = 20_000, 6, [0, 1]
    base = torch.tensor([[1.0, 0.2, 0.8, -0.5, 0.1, 0.6], [0.3, 1.2, -0.2, 0.0, 0.4, -1.0],
                         [0.0, 0.5, 0.9, 0.1, -0.3, 0.2]])
    b = SpecBatch.build(spec_rows(n, drafts, params), v, torch.device("cpu"), lambda r: None)
    tokens, accepted = verify(base.repeat(n, 1), b)
    tokens = tokens.view(n, 3)
    p = filter_logits(base, params.temperature, params.top_k, params.top_p, params.min_p).softmax(-1)
    given = torch.ones(n, dtype=torch.bool)
    for j in range(3):
        sub = tokens[given & (accepted >= j), j]
        freq = torch.bincount(sub, minlength=v).float() / len(sub)
        sigma = (p[j] * (1 - p[j]) / len(sub)).sqrt()
        assert ((freq - p[j]).abs() <= 5 * sigma + 1e-9).all(), (j, freq, p[j])
        assert len(sub) > 1000
        if j < 2:
            given &= tokens[:, j] == drafts[j]
    # a token is accepted only when it is the draft; acceptance of draft 1 happens with probability p_0(d)
    assert abs((accepted >= 1).float().mean().item() - p[0, drafts[0]].item()) < 0.02


@contextmanager
def count_host_reads(model):
    """Count the runner's device-to-host reads (tolist, item, bool(), cpu(), ...) outside the
    model's own forward passes (MoE routing inside the model is counted separately)."""
    counts = {"runner": 0, "model": 0}
    inside = [0]
    names = ["tolist", "item", "__bool__", "__int__", "__float__", "cpu", "numpy"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        def f(self, *a, **kw):
            counts["model" if inside[0] else "runner"] += 1
            return saved[name](self, *a, **kw)
        return f

    def within(fn):
        def f(*a, **kw):
            inside[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                inside[0] -= 1
        return f

    wrapped = ["forward", "mtp_forward", "mtp_draft"]
    for name in wrapped:
        setattr(model, name, within(getattr(model, name)))
    for n in names:
        setattr(torch.Tensor, n, counting(n))
    try:
        yield counts
    finally:
        for n in names:
            setattr(torch.Tensor, n, saved[n])
        for name in wrapped:
            delattr(model, name)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9)])
def test_a_speculative_step_reads_the_device_once(params):
    model = load_model(DEFAULT_MODEL, dtype="float32")
    runner = ModelRunner(model, num_blocks=16, block_size=4, device=torch.device("cpu"), num_spec_tokens=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16]]
    rows = [ScheduledRequest(f"r{i}", p, 0, [4 * i + j for j in range(4)], True, params, spec=True)
            for i, p in enumerate(prompts)]
    first = runner.execute_model(SchedulerOutput(rows, num_decode=0))
    assert [len(d) for d in first.draft_token_ids] == [2, 2]
    decode = [ScheduledRequest(r.request_id, [tok] + d, len(p), r.block_table, True, params, num_draft=2, spec=True)
              for r, p, tok, d in zip(rows, prompts, first.sampled_token_ids, first.draft_token_ids)]
    with count_host_reads(model) as counts:
        out = runner.execute_model(SchedulerOutput(decode, num_decode=2))
    assert counts["runner"] == 1
    assert all(1 <= len(t) <= 3 for t in out.new_token_ids) and [len(d) for d in out.draft_token_ids] == [2, 2]


@pytest.mark.parametrize("lens", [(3, 1, 2), (2, 2)])
def test_multi_query_decode_rows_match_prefill_chunks(lens):
    """Decode rows carrying drafts (k + 1 queries each, of different lengths or equal) attend
    causally through the absorbed path and give the hidden states of the same tokens computed
    as prefill chunks (the unabsorbed path)."""
    from matrixinfer.model.context import forward_context
    from matrixinfer.worker.spec_decode import add_decode_queries

    model = load_model(DEFAULT_MODEL, dtype="float32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4000, (5 + i,), generator=g).tolist() for i in range(len(lens))]
    news = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lens]

    def hidden(as_decode: bool):
        runner = ModelRunner(model, num_blocks=16, block_size=4, device=torch.device("cpu"))
        tables = [[4 * i + j for j in range(4)] for i in range(len(lens))]
        runner.run([ScheduledRequest(f"r{i}", p, 0, t, False) for i, (p, t) in enumerate(zip(prompts, tables))], 0)
        rows = [ScheduledRequest(f"r{i}", n, len(p), t, False, num_draft=len(n) - 1)
                for i, (p, n, t) in enumerate(zip(prompts, news, tables))]
        if not as_decode:
            return runner.run(rows, 0)
        ids, pos, ctx = runner.prepare(rows, len(rows))
        add_decode_queries(ctx, rows, torch.device("cpu"))
        assert ctx.decode_query_len == max(lens)
        with forward_context(ctx):
            return model(ids, pos)

    with torch.inference_mode():
        assert torch.allclose(hidden(True), hidden(False), atol=1e-4)


def test_drafting_rows_only_equals_the_full_mtp_forward():
    """The MTP module computes attention, MLP and head only at the rows it drafts from, yet
    writes the same KV and gives those rows the same hidden states as running it everywhere."""
    from matrixinfer.model.context import forward_context
    from matrixinfer.worker.spec_decode import add_decode_queries, draft_context

    model = load_model(DEFAULT_MODEL, dtype="float32")
    runner = ModelRunner(model, num_blocks=16, block_size=4, device=torch.device("cpu"), num_spec_tokens=1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (6, 9)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    runner.execute_model(SchedulerOutput([ScheduledRequest(f"r{i}", p, 0, t, True, SamplingParams(temperature=0),
                                                           spec=True) for i, (p, t) in enumerate(zip(prompts, tables))],
                                         num_decode=0))
    rows = [ScheduledRequest(f"r{i}", [7, 8], len(p), t, True, SamplingParams(temperature=0), num_draft=1, spec=True)
            for i, (p, t) in enumerate(zip(prompts, tables))]
    b = SpecBatch.build(rows, model.config.vocab_size, torch.device("cpu"), lambda r: None)
    ids, pos, ctx = runner.prepare(rows, 2)
    add_decode_queries(ctx, rows, torch.device("cpu"))
    at = torch.tensor([0, 3])  # the first row of r0 (draft rejected), the second of r1 (accepted)
    cache = runner.kv_cache[-1]
    with torch.inference_mode(), forward_context(ctx):
        hidden = model(ids, pos)
        saved = cache.clone()
        full = model.mtp_forward(hidden, ids, pos + 1)[at]
        full_kv = cache.clone()
        cache.copy_(saved)
        rows_only = model.mtp_draft(hidden, ids, pos + 1, at, draft_context(ctx, b, pos[at], rows, 0, 4))
    assert torch.allclose(rows_only, full, atol=1e-5)
    assert torch.equal(cache, full_kv)
