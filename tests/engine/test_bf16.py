"""The bfloat16 path (the bundled checkpoint's own dtype, what `LLM()` runs by default):
paged prefill + absorbed decode in bf16 stay within a stated tolerance of the float32
dense model, step by step, on the trained model."""

import torch

from matrixinfer.engine import DEFAULT_MODEL
from matrixinfer.engine.block_manager import BlockManager
from matrixinfer.engine.model_runner import ModelRunner
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.sequence import Sequence
from matrixinfer.engine.tokenizer import Tokenizer
from matrixinfer.model.loader import load_model


def test_bf16_paged_decode_tracks_float32():
    ids = Tokenizer(DEFAULT_MODEL).encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n")
    ref_model = load_model(DEFAULT_MODEL, dtype="float32")
    with torch.no_grad():
        ref = ref_model.compute_logits(ref_model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    model = load_model(DEFAULT_MODEL, dtype="bfloat16")
    bm = BlockManager(num_blocks=8, block_size=16)
    runner = ModelRunner(model, num_blocks=8, block_size=16, device=torch.device("cpu"))
    n0 = len(ids) - 8
    seq = Sequence("r", 0, ids[:n0], SamplingParams())
    steps = [(n0, runner.run([seq], [bm.allocate(seq, n0)], [True]))]
    seq.num_computed_tokens = n0
    for t in range(n0, len(ids)):
        seq.output_token_ids.append(ids[t])
        steps.append((t + 1, runner.run([seq], [bm.allocate(seq, 1)], [True])))
        seq.num_computed_tokens += 1
    for n, logits in steps[:-1]:
        r = ref[n - 1]
        rel = ((logits[0].float() - r).norm() / r.norm()).item()
        assert rel < 0.015, f"position {n - 1}: bf16 relative error {rel:.3f}"
        assert logits[0].argmax() == r.argmax() or r.topk(2).values.diff().abs() < 0.1
