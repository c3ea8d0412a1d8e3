"""Self-distillation of the MTP module: it learns the main model's own next-next token, and
the rewritten checkpoint differs from the original in MTP tensors only."""

import torch
from safetensors import safe_open

from matrixinfer.model.loader import load_model
from matrixinfer.train.distill import agreement, distill, replace_mtp_tensors
from tests.train.test_checkpoint import MODEL


def test_distillation_raises_agreement_and_changes_only_mtp_tensors(tmp_path):
    torch.manual_seed(0)
    model = load_model(MODEL, dtype="float32")
    # a small repetitive stream: a few steps are enough to move the MTP module towards the main model
    stream = torch.randint(3, 200, (64,)).repeat(40)
    held = stream[:8 * 33].view(8, 33)
    main_before = {k: v.clone() for k, v in model.state_dict().items() if ".mtp." not in k}
    log = distill(model, stream, held, steps=12, batch_size=4, seq_len=33, lr=2e-3, log_every=12)
    assert log[-1]["heldout_agreement"] > log[0]["heldout_agreement"] + 0.05
    assert agreement(model, held) == log[-1]["heldout_agreement"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in main_before.items())  # the main model is frozen
    out = tmp_path / "model.safetensors"
    assert replace_mtp_tensors(model, MODEL / "model.safetensors", out) > 0
    with safe_open(str(MODEL / "model.safetensors"), "pt") as a, safe_open(str(out), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        changed = {k for k in a.keys() if not torch.equal(a.get_tensor(k), b.get_tensor(k))}
    assert changed and all(k.startswith("model.layers.4.") for k in changed)
