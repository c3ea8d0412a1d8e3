"""The compiled decode step (worker/compiled_decode.py) against the eager forward it replaces."""

import pytest
import torch
from torch._dynamo.utils import counters

from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.kernels import argmax_rows
from matrixinfer.model.loader import load_model
from matrixinfer.worker import compiled_decode
from matrixinfer.worker.compiled_decode import STATIC_BATCHES, NotReplayable, Replay, padded_batch
from matrixinfer.worker.model_runner import ModelRunner
from tests.hf_fixtures import make_checkpoint


def test_small_batches_pad_to_a_static_bucket():
    assert [padded_batch(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 9, 33]
    assert STATIC_BATCHES[0] == 1


def test_a_step_that_is_not_one_graph_call_is_not_replayed_and_says_why():
    """Replay.record refuses a step it cannot vouch for and names the failed check (the
    warm-up logs it): an eager step runs no inductor graph, a step with a graph break two."""

    def two_graphs(ids, pos, slots, tables, lens):
        x = ids * 2
        torch._dynamo.graph_break()
        return (x + pos,)

    steps = [(torch.arange(3), torch.arange(3), torch.arange(3), torch.zeros(3, w, dtype=torch.long),
              torch.ones(3, dtype=torch.long)) for w in (3, 4)]
    with pytest.raises(NotReplayable, match=r"graph calls per step: \[0, 0\]"):
        Replay.record(lambda *inputs: (inputs[0] + 1,), None, steps)
    with pytest.raises(NotReplayable, match=r"graph calls per step: \[2, 2\]"):
        Replay.record(torch.compile(two_graphs), None, steps)


@pytest.mark.slow
def test_compiled_decode_equals_eager_without_graph_breaks(tmp_path, monkeypatch):
    """Decode-only steps of 1, 3, 5 and 12 sequences over random cached latents (3 and 5 pad
    to a static bucket, 12 runs the dynamic graph; each expert path: gathered pairs, every
    expert) give the eager runner's hidden states (float32, 1e-5) and write the same latents;
    the padding rows write only into the pad block, past the blocks the KV manager hands out;
    the logits computed inside the graph equal the eager head's and its argmax is the sampler's
    greedy pick; the graphs call the operators through their C shims. Every size's graph runs as a replay (called past torch.compile's wrappers) and gives way to the compiled path when the
    cache views are re-bound.
    One graph per bucket, all compiled by the warm-up: no graph breaks (so no host syncs in
    the MoE) and no recompiles while serving, also when the block tables widen; every batch
    size up to 12 runs without one, also through torch.compile's guards rather than a replay
    after the prefill warm-up (which marks weights static: the decode warm-up must mark them
    first). Every graph, static or dynamic, had its guards filtered (once torch.compile took
    the filter out of a dict both graphs shared, and the dynamic graph checked every parameter
    at every step)."""
    make_checkpoint(tmp_path, "v3-qlora-yarn")  # 8 experts, top-3
    model = load_model(tmp_path, dtype="float32")
    filtered = []  # one call per graph compiled
    keep = compiled_decode._guards_to_keep
    monkeypatch.setattr(compiled_decode, "_guards_to_keep", lambda entries: filtered.append(1) or keep(entries))
    blocks, bs = 64, 4
    compiled = ModelRunner(model, num_blocks=blocks, block_size=bs, device=torch.device("cpu"), compile_decode=True,
                           compile_prefill=True)
    # a model of its own: a runner binds its model's layers to its cache
    eager = ModelRunner(load_model(tmp_path, dtype="float32"), num_blocks=blocks, block_size=bs,
                        device=torch.device("cpu"))
    assert compiled.kv_cache.shape[1] == blocks + 1 and compiled.compiled_decode.pad_block == blocks
    g = torch.Generator().manual_seed(0)
    counters.clear()
    compiled.compiled_decode.warm_up(12, torch.device("cpu"))
    frames = counters["stats"]["unique_graphs"]
    # a whole-forward graph per bucket (1, 2, 4, 8 static) and per MoE path range of the
    # dynamic one (9-10 every expert, 11-12 the grouped matmul), not the forward in pieces
    # (generators, graph breaks): a piecewise step keeps most of the overhead
    assert frames <= len(STATIC_BATCHES) + 2, frames
    assert len(filtered) == frames
    # every size's graph replays directly: the static buckets and 9 ... 12 of the dynamic graph
    assert sorted(compiled.compiled_decode.replays) == [*STATIC_BATCHES, *range(9, 13)]
    compiled.compiled_prefill.warm_up(8, torch.device("cpu"))  # after decode, as ModelRunner.warm_up orders them
    frames += compiled.compiled_prefill.graphs
    for b in (1, 3, 5, 12, 3):
        compiled.kv_cache[:, :blocks].normal_(generator=g)
        eager.kv_cache.copy_(compiled.kv_cache[:, :blocks])
        pad_before = compiled.kv_cache[:, blocks:].clone()
        lens = torch.randint(1, 30, (b,), generator=g).tolist()
        order = torch.randperm(blocks, generator=g).tolist()
        reqs = []
        for i, n in enumerate(lens):
            table, order = order[: -(-n // bs)], order[-(-n // bs):]
            reqs.append(ScheduledRequest(f"r{i}", [int(torch.randint(0, model.config.vocab_size, (1,),
                                                                         generator=g))], n - 1, table, True))
        out, logits, greedy = compiled.run_step(reqs, num_decode=b)
        ref = eager.run(reqs, num_decode=b)
        assert out.shape == ref.shape == (b, model.config.hidden_size)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (b, (out - ref).abs().max())
        with torch.inference_mode():  # the head and the greedy pick ran inside the graph
            ref_logits = eager.model.compute_logits(ref)
            assert torch.allclose(logits[:b], ref_logits, rtol=1e-5, atol=1e-5)
            assert torch.equal(greedy[:b], argmax_rows(ref_logits))
            assert torch.equal(greedy, argmax_rows(logits))
        # the same latents written, and nothing outside the pad block by the padding rows
        assert torch.allclose(compiled.kv_cache[:, :blocks], eager.kv_cache, rtol=1e-5, atol=1e-5)
        if b == padded_batch(b):
            assert torch.equal(compiled.kv_cache[:, blocks:], pad_before)
    for b in range(1, 13):  # every size the warm-up covered, none compiles again
        reqs = [ScheduledRequest(f"s{i}", [1], 0, [i], True) for i in range(b)]
        compiled.run(reqs, num_decode=b)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == frames  # the warm-up compiled every bucket
    assert compiled.compiled_decode.steps == 8 + 5 + 12  # the warm-up's 1, 2, 4, 8, 9 ... 12 and the steps above
    # past the replays, through torch.compile's guards: the prefill warm-up left the decode
    # graphs valid (when only it marked the packed weights static, every decode graph failed its
    # guards afterwards, and a served step of 9 sequences, not replayed, recompiled for 20.5 s)
    replays = dict(compiled.compiled_decode.replays)
    compiled.compiled_decode.replays.clear()
    for b in (1, 3, 9, 12):
        compiled.run([ScheduledRequest(f"g{i}", [1], 0, [i], True) for i in range(b)], num_decode=b)
    assert counters["stats"]["unique_graphs"] == frames
    compiled.compiled_decode.replays.update(replays)
    # the graphs call the operators (paged attention every step, small_mm at 12) through their C
    # shims: none through the dispatcher, where torch.profiler records every call
    from torch.profiler import profile

    with profile() as prof:
        for b in (1, 12):
            compiled.run([ScheduledRequest(f"p{i}", [1], 3, [i], True) for i in range(b)], num_decode=b)
    assert not [e.key for e in prof.key_averages() if e.key.startswith("matrixinfer::")]
    # a runner that re-binds the cache views: the replays go, the compiled path (its guard on
    # the views) runs the step on the new ones
    cache = torch.randn(compiled.kv_cache.shape, generator=g)
    for i, attn in enumerate(compiled.model.attention_layers()):
        attn.kv_cache = cache[i]
    eager.kv_cache.copy_(cache[:, :blocks])
    reqs = [ScheduledRequest("t", [1], 5, [0, 1], True)]
    assert torch.allclose(compiled.run(reqs, num_decode=1), eager.run(reqs, num_decode=1), rtol=1e-5, atol=1e-5)
    assert not compiled.compiled_decode.replays
