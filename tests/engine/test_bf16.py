"""The bfloat16 path (the bundled checkpoint's own dtype, what `LLM()` runs by default):
paged prefill + absorbed decode in bf16 stay within a stated tolerance of the float32
dense model, step by step, on the trained model."""

import torch

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.tokenizer import Tokenizer
from matrixinfer.model.loader import load_model
from tests.paged import PagedSequence


def test_bf16_paged_decode_tracks_float32():
    ids = Tokenizer(DEFAULT_MODEL).encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n")
    ref_model = load_model(DEFAULT_MODEL, dtype="float32")
    with torch.no_grad():
        ref = ref_model.compute_logits(ref_model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0]
    model = load_model(DEFAULT_MODEL, dtype="bfloat16")
    seq = PagedSequence(model, num_blocks=8, block_size=16)
    n0 = len(ids) - 8
    steps = [(n0, seq.step(ids[:n0]))]
    for t in range(n0, len(ids) - 1):
        steps.append((t + 1, seq.step([ids[t]])))
    for n, logits in steps:
        r = ref[n - 1]
        rel = ((logits.float() - r).norm() / r.norm()).item()
        assert rel < 0.015, f"position {n - 1}: bf16 relative error {rel:.3f}"
        assert logits.argmax() == r.argmax() or r.topk(2).values.diff().abs() < 0.1
