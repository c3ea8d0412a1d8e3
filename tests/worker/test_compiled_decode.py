"""The compiled decode step (worker/compiled_decode.py) against the eager forward it replaces."""

import pytest
import torch
from torch._dynamo.utils import counters

from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.loader import load_model
from matrixinfer.worker.compiled_decode import CompiledDecode
from matrixinfer.worker.model_runner import ModelRunner
from tests.hf_fixtures import make_checkpoint


@pytest.mark.slow
def test_compiled_decode_equals_eager_without_graph_breaks(tmp_path):
    """Decode-only batches of 1, 2 and 5 sequences (each expert path: gathered pairs, every
    expert) over random cached latents give the eager hidden states (float32, 1e-5), in one
    graph per batch-size range: no graph breaks (so no host syncs in the MoE) and no
    recompiles beyond the warm-up's."""
    make_checkpoint(tmp_path, "v3-qlora-yarn")  # 8 experts, top-3
    model = load_model(tmp_path, dtype="float32")
    runner = ModelRunner(model, num_blocks=64, block_size=4, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    runner.kv_cache.normal_(generator=g)
    counters.clear()
    compiled = CompiledDecode(model)
    compiled.warm_up(8, torch.device("cpu"))
    frames = counters["stats"]["unique_graphs"]
    # one whole-forward graph per batch-size range (1; 2 and up here), not the forward in
    # pieces (generators, graph breaks): a piecewise step keeps most of the overhead
    assert frames <= 3, frames
    for b in (1, 2, 5, 3):
        with torch.inference_mode():  # as the runner builds its inputs (a guard checks it)
            lens = torch.randint(1, 30, (b,), generator=g)
            width = int(-(-lens.max() // 4)) + 1
            tables = torch.randperm(64, generator=g)[: b * width].view(b, width)
            slots = tables.gather(1, ((lens - 1) // 4)[:, None])[:, 0] * 4 + (lens - 1) % 4
            ids = torch.randint(0, model.config.vocab_size, (b,), generator=g)
            ctx = ForwardContext([], [], slots, tables, b, lens, decode_only=True)
            eager_cache = runner.kv_cache.clone()
            with forward_context(ctx):
                ref = model(ids, lens - 1)
            eager_cache, runner.kv_cache[:] = runner.kv_cache.clone(), eager_cache  # replay from the same cache
            out = compiled(ids, lens - 1, ctx)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (b, (out - ref).abs().max())
        assert torch.allclose(runner.kv_cache, eager_cache, rtol=1e-5, atol=1e-5)  # it wrote the same latents
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == frames  # the warm-up compiled every range
