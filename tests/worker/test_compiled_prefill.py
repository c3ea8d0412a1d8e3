"""Steps of whole new prompts: the attention that reads the step's own latents
(MLAttention._attend_fresh) against the one that reads them back from the paged cache, and
the compiled prefill step (worker/compiled_prefill.py) against the eager forward."""

import pytest
import torch
from torch._dynamo.utils import counters

from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.model.context import forward_context
from matrixinfer.model.loader import load_model
from matrixinfer.worker.compiled_prefill import MIN_WARM_TOKENS, warm_sizes
from matrixinfer.worker.model_runner import ModelRunner
from tests.hf_fixtures import make_checkpoint

CPU = torch.device("cpu")


def _prompts(lens: list[int], vocab: int, g: torch.Generator, bs: int, first_block: int = 0):
    """One ScheduledRequest per whole prompt of each length, on consecutive blocks."""
    reqs, block = [], first_block
    for i, n in enumerate(lens):
        table = list(range(block, block + -(-n // bs)))
        block += len(table)
        reqs.append(ScheduledRequest(f"r{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), 0, table, True))
    return reqs


def test_warm_sizes_cover_the_ranges_between_powers_of_two():
    assert warm_sizes(40) == [MIN_WARM_TOKENS, 6, 8, 12, 16, 24, 32, 40]
    assert warm_sizes(2048)[-3:] == [1024, 1536, 2048] and warm_sizes(MIN_WARM_TOKENS) == [MIN_WARM_TOKENS]


def test_fresh_prompt_attention_equals_reading_the_cache(tmp_path):
    """A step of three whole prompts gets prompt_cu_seqlens, and attending within the step's
    latents (one varlen operator) gives the hidden states and cache of the per-sequence path
    that reads them back from the paged cache. Steps with a decode row or a prompt continued
    past position 0 (a prefix hit, a later chunk) do not get it."""
    make_checkpoint(tmp_path, "v3-qlora-yarn")
    model = load_model(tmp_path, dtype="float32")
    runner = ModelRunner(model, num_blocks=32, block_size=4, device=CPU)
    g = torch.Generator().manual_seed(0)
    reqs = _prompts([5, 9, 3], model.config.vocab_size, g, 4)
    ids, pos, ctx = runner.prepare(reqs, 0)
    assert ctx.prompt_cu_seqlens.tolist() == [0, 5, 14, 17]
    with torch.inference_mode():
        with forward_context(ctx):
            fresh = model(ids, pos)
        cache = runner.kv_cache.clone()
        runner.kv_cache.zero_()
        ctx.prompt_cu_seqlens = None  # the path of any prefill chunk: the latents read back from the cache
        with forward_context(ctx):
            paged = model(ids, pos)
    assert torch.allclose(fresh, paged, rtol=1e-5, atol=1e-5), (fresh - paged).abs().max()
    assert torch.allclose(runner.kv_cache, cache, rtol=1e-5, atol=1e-5)
    later = ScheduledRequest("c", [3, 4], 5, reqs[0].block_table + [20], True)
    assert runner.prepare([reqs[1], later], 0)[2].prompt_cu_seqlens is None
    decode = ScheduledRequest("d", [7], 5, reqs[0].block_table + [20], True)
    assert runner.prepare([decode, reqs[1]], 1)[2].prompt_cu_seqlens is None


@pytest.mark.slow
def test_compiled_prefill_equals_eager_and_the_warm_up_covers_every_size(tmp_path):
    """After warm_up(40), steps of whole prompts of every total from MIN_WARM_TOKENS to 40
    tokens, one prompt or several, run on a compiled graph without compiling again (the
    "fail_on_recompile" stance raises otherwise) and give the eager runner's hidden states
    (float32, 1e-5) and latents. A graph per token-count range, no graph breaks, and the
    warm-up's dummy prompts wrote only into the pad block. Steps no graph covers (one or two
    tokens) run eagerly under the serving stance, and a step with a continued prompt is not
    sent to the compiled graph."""
    make_checkpoint(tmp_path, "v3-qlora-yarn")  # 8 experts, top-3
    blocks, bs = 64, 4
    # prefill compiled alone, as on a PDC prefill instance: it still gets the pad block
    compiled = ModelRunner(load_model(tmp_path, dtype="float32"), num_blocks=blocks, block_size=bs, device=CPU,
                           compile_decode=False, compile_prefill=True)
    eager = ModelRunner(load_model(tmp_path, dtype="float32"), num_blocks=blocks, block_size=bs, device=CPU)
    prefill = compiled.compiled_prefill
    assert prefill.pad_block == blocks and compiled.kv_cache.shape[1] == blocks + 1
    counters.clear()
    prefill.warm_up(40, CPU)
    assert 1 <= prefill.graphs <= 4 and counters["stats"]["unique_graphs"] == prefill.graphs
    assert not compiled.kv_cache[:, :blocks].any()  # the dummy prompts wrote into the pad block only
    vocab = compiled.model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prefill.stance = "fail_on_recompile"
    steps = [[n] for n in range(MIN_WARM_TOKENS, 41, 3)] + [[40], [3, 9, 5], [13, 1, 2, 20], [2, 2]]
    for lens in steps:
        reqs = _prompts(lens, vocab, g, bs)
        out, ref = compiled.run(reqs, 0), eager.run(reqs, 0)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (lens, (out - ref).abs().max())
        assert torch.allclose(compiled.kv_cache[:, :blocks], eager.kv_cache, rtol=1e-5, atol=1e-5)
    assert prefill.steps == len(steps)
    prefill.stance = "eager_on_recompile"
    for lens in ([1], [2]):
        reqs = _prompts(lens, vocab, g, bs)
        assert torch.allclose(compiled.run(reqs, 0), eager.run(reqs, 0), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == prefill.graphs and not counters["graph_break"]
    cont = ScheduledRequest("c", [3, 4, 5], 4, [0, 1], True)
    assert torch.allclose(compiled.run([cont], 0), eager.run([cont], 0), rtol=1e-5, atol=1e-5)
    assert prefill.steps == len(steps) + 2
