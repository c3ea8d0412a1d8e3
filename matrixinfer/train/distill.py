"""Self-distillation of the MTP module: the main model frozen, the MTP module alone trained to
predict the main model's own next-next token (its distribution at position i+1), not the
corpus's. Speculative decoding accepts a draft when it matches the main model's choice, so
this is the acceptance the module is trained for.

At window position i the module reads h_i and the corpus token t_{i+1}, as in pretraining;
the target is softmax(main logits at i+1), the main model's prediction once it has seen
t_{i+1}. Only the MTP tensors change: `replace_mtp_tensors` rewrites them in a checkpoint
and checks that every other tensor is bit-identical to the original.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from matrixinfer.model.deepseek import DeepseekForCausalLM


def mtp_parameters(model: DeepseekForCausalLM) -> list[torch.nn.Parameter]:
    return [p for m in model.model.mtp for p in m.parameters()]


def distill_loss(model: DeepseekForCausalLM, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """window [B, T] -> (soft cross-entropy against the main model's next-next distribution,
    top-1 agreement with the main model's argmax there)."""
    b, t = window.shape
    pos = torch.arange(t).expand(b, t)
    with torch.no_grad():
        h = model(window, pos)
        teacher = model.compute_logits(h[:, 1:]).float()
    h2 = model.mtp_forward(h[:, :-1], window[:, 1:], pos[:, 1:])
    student = model.compute_logits(h2).float()
    loss = -(teacher.softmax(-1) * student.log_softmax(-1)).sum(-1).mean()
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return loss, agree


@torch.no_grad()
def agreement(model: DeepseekForCausalLM, windows: torch.Tensor, batch: int = 8) -> float:
    """Top-1 agreement of the MTP module with the main model's own next-next token (teacher-forced
    on held-out text): what greedy verification accepts, position by position."""
    hits = total = 0.0
    for i in range(0, len(windows), batch):
        _, a = distill_loss(model, windows[i:i + batch])
        n = windows[i:i + batch, 1:].numel()
        hits, total = hits + a.item() * n, total + n
    return hits / total


def distill(model: DeepseekForCausalLM, train_stream: torch.Tensor, held: torch.Tensor, steps: int,
            batch_size: int = 8, seq_len: int = 256, lr: float = 5e-4, seed: int = 0, log_every: int = 25) -> list[dict]:
    from matrixinfer.train.tiny import sample_windows

    for p in model.parameters():
        p.requires_grad_(False)
    params = mtp_parameters(model)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(seed)
    log, t0 = [{"step": 0, "heldout_agreement": agreement(model, held)}], time.perf_counter()
    print(log[-1], flush=True)
    for step in range(steps):
        for g in opt.param_groups:  # cosine to 10 %
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        window = sample_windows(train_stream, batch_size, seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, agree = distill_loss(model, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        entry = {"step": step + 1, "loss": loss.item(), "train_agreement": agree.item(),
                 "elapsed_s": round(time.perf_counter() - t0, 1)}
        if (step + 1) % log_every == 0 or step + 1 == steps:
            entry["heldout_agreement"] = agreement(model, held)
            print(entry, flush=True)
        log.append(entry)
    for p in model.parameters():
        p.requires_grad_(False)
    return log


def replace_mtp_tensors(model: DeepseekForCausalLM, checkpoint: Path, out: Path) -> int:
    """Write `checkpoint`'s model.safetensors to `out` with the MTP module's tensors taken from
    `model` (in the file's dtype); every other tensor is checked bit-identical. Returns the
    number of tensors replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from matrixinfer.model.saver import checkpoint_state_dict

    with safe_open(str(checkpoint), "pt") as f:
        meta = f.metadata()
        original = {k: f.get_tensor(k) for k in f.keys()}
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    new = checkpoint_state_dict(model, next(iter(original.values())).dtype)
    replaced = 0
    out_tensors = {}
    for name, t in original.items():
        if name.startswith(mtp_prefix) and not name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            out_tensors[name] = new[name].to(t.dtype)
            replaced += not torch.equal(out_tensors[name], t)
        else:
            out_tensors[name] = t
            if not torch.equal(new[name].to(t.dtype), t):
                raise RuntimeError(f"{name} changed: only MTP tensors may change")
    save_file(out_tensors, str(out), metadata=meta)
    return replaced


def run(model_dir: Path, out_dir: Path, steps: int, batch_size: int, seq_len: int, lr: float, threads: int,
        heldout_windows: int = 32) -> dict:
    """Distill model_dir's MTP module on its training corpus; write a copy of model_dir with the
    new MTP tensors to out_dir. -> {"before": agreement, "after": agreement, "log": [...]}."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from matrixinfer.model.loader import load_model
    from matrixinfer.train.corpus import read_texts, split
    from matrixinfer.train.tiny import eval_windows, token_stream
    from matrixinfer.train.tokenizer import encode_documents

    torch.set_num_threads(threads)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_files, held_files = split()
    train_stream = token_stream(encode_documents(tok, read_texts(train_files)))
    held = eval_windows(token_stream(encode_documents(tok, read_texts(held_files))), seq_len, heldout_windows)
    model = load_model(model_dir, dtype="float32")
    model.train()
    log = distill(model, train_stream, held, steps, batch_size, seq_len, lr)
    model.eval()
    result = {"before": log[0]["heldout_agreement"], "after": log[-1]["heldout_agreement"], "steps": steps,
              "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "log": log}
    if out_dir != model_dir:
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    result["replaced_tensors"] = replace_mtp_tensors(model, model_dir / "model.safetensors",
                                                     out_dir / "model.safetensors")
    (out_dir / "mtp_distill_log.json").write_text(json.dumps(result) + "\n")
    return result
