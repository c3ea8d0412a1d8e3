"""Train the tiny DeepSeek-V3-architecture model: MLA, a dense first layer then DeepSeekMoE
layers routed by noaux_tc (grouped top-k on sigmoid scores plus a correction bias learned
by the aux-loss-free bias-update rule), and one MTP module trained with the MTP loss.

Deterministic given the seed: fixed data order from a seeded generator, deterministic
algorithms, a fixed thread count.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from matrixinfer.config import ModelConfig
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.layers import LinearBase, RMSNorm, RoutedExperts
from matrixinfer.model.moe import Router
from matrixinfer.model.saver import save_pretrained

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe"

# The shipped architecture (DeepSeek-V3 at small scale). Names are config.json keys.
TINY_ARCH = dict(
    hidden_size=256, intermediate_size=768, moe_intermediate_size=192,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
    q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, num_nextn_predict_layers=1,
    max_position_embeddings=1024, rms_norm_eps=1e-6,
)


def hf_config(vocab_size: int, bos_id: int = 0, eos_id: int = 1, pad_id: int = 2, **overrides) -> dict:
    """config.json of the model, written by transformers' own DeepseekV3Config."""
    from transformers import DeepseekV3Config

    arch = {**TINY_ARCH, **overrides}
    cfg = DeepseekV3Config(
        vocab_size=vocab_size, num_key_value_heads=arch["num_attention_heads"], rope_interleave=True,
        tie_word_embeddings=False, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        initializer_range=0.02, **arch,
    ).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    for k in ("id2label", "label2id", "problem_type", "dtype", "output_hidden_states", "output_attentions",
              "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "_name_or_path"):
        cfg.pop(k, None)
    return cfg


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 900
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    bias_update_speed: float = 1e-2  # gamma of the aux-loss-free balancing rule (DeepSeek-V3: 1e-3 over far more steps)
    eval_every: int = 50
    eval_windows: int = 16
    save_every: int = 100
    threads: int = 2
    autocast_bf16: bool = True  # bf16 matmuls (fp32 master weights, fp32 losses): ~25% faster on CPU


def init_weights(model: DeepseekForCausalLM, std: float = 0.02) -> None:
    """Every parameter and buffer explicitly (the modules leave some uninitialized):
    normal(std) for linears, embeddings and routers, ones for norms, zero correction bias;
    residual-branch outputs (o_proj, down_proj) scaled by 1/sqrt(2 * layers)."""
    n_layers = model.config.num_hidden_layers + len(model.model.mtp)
    with torch.no_grad():
        residual = std / math.sqrt(2 * n_layers)
        for name, m in model.named_modules():
            if isinstance(m, LinearBase):
                m.weight.normal_(0.0, residual if name.endswith(("o_proj", "down_proj")) else std)
            elif isinstance(m, RoutedExperts):
                m.w13_weight.normal_(0.0, std)
                m.w2_weight.normal_(0.0, residual)  # the experts' down_proj
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, Router):
                m.weight.normal_(0.0, std)
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.zero_()
        for layer in model.attention_layers():
            layer.rotary.reset_parameters()


def update_bias(bias: torch.Tensor, load: torch.Tensor, speed: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3): after each step, raise the routing bias of
    under-loaded experts and lower it for over-loaded ones, by a fixed step `speed`."""
    load = load.float()
    bias.add_(speed * torch.sign(load.mean() - load))


class LoadMeter:
    """Counts tokens per routed expert for every router (forward hooks on Router)."""

    def __init__(self, model: nn.Module):
        self.routers = {name: m for name, m in model.named_modules() if isinstance(m, Router)}
        self.counts = {name: torch.zeros(m.n_experts, dtype=torch.long) for name, m in self.routers.items()}
        self._hooks = [m.register_forward_hook(self._hook(name)) for name, m in self.routers.items()]

    def _hook(self, name):
        def hook(module, inputs, output):
            ids = output[1]
            self.counts[name] += torch.bincount(ids.flatten().cpu(), minlength=module.n_experts)
        return hook

    def reset(self) -> None:
        for c in self.counts.values():
            c.zero_()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def build_model(cfg_dict: dict, seed: int) -> DeepseekForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekForCausalLM(ModelConfig.from_hf(cfg_dict))
    init_weights(model)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def losses(model: DeepseekForCausalLM, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """window: [B, T+1] token ids. Main loss predicts t_{i+1}; the MTP module combines h_i with
    emb(t_{i+1}) (rope position i+1) and predicts t_{i+2}."""
    x, y = window[:, :-1], window[:, 1:]
    b, t = x.shape
    pos = torch.arange(t).expand(b, t)
    h = model(x, pos)
    main = F.cross_entropy(model.compute_logits(h).flatten(0, 1).float(), y.flatten())
    h2 = model.mtp_forward(h[:, :-1], x[:, 1:], pos[:, 1:])
    mtp = F.cross_entropy(model.compute_logits(h2).flatten(0, 1).float(), y[:, 1:].flatten())
    return main, mtp


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of `length` tokens (each target token is scored once)."""
    n = (len(stream) - 1) // (length - 1)
    if limit is not None:
        n = min(n, limit)
    return torch.stack([stream[i * (length - 1) : i * (length - 1) + length] for i in range(n)])


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    p = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def make_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


@torch.no_grad()
def heldout_loss(model: DeepseekForCausalLM, windows: torch.Tensor, batch: int = 8) -> tuple[float, float]:
    was = model.training
    model.eval()
    tot_main = tot_mtp = 0.0
    for i in range(0, len(windows), batch):
        m, t = losses(model, windows[i : i + batch])
        tot_main += m.item() * len(windows[i : i + batch])
        tot_mtp += t.item() * len(windows[i : i + batch])
    model.train(was)
    return tot_main / len(windows), tot_mtp / len(windows)


def train(
    model: DeepseekForCausalLM, train_stream: torch.Tensor, tc: TrainConfig, heldout_stream: torch.Tensor | None = None,
    on_checkpoint=None, progress: bool = True,
) -> list[dict]:
    """Runs tc.steps optimizer steps; returns the log (one dict per step, eval losses where measured).
    `on_checkpoint(step, log)` is called every tc.save_every steps and at the end."""
    from tqdm import tqdm

    torch.set_num_threads(tc.threads)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(tc.seed)
    opt = make_optimizer(model, tc)
    meter = LoadMeter(model)
    held = eval_windows(heldout_stream, tc.seq_len + 1, tc.eval_windows) if heldout_stream is not None else None
    log: list[dict] = []
    tokens = 0
    t0 = time.perf_counter()
    bar = tqdm(range(tc.steps), disable=not progress, dynamic_ncols=True, mininterval=2.0)
    model.train()
    for step in bar:
        window = sample_windows(train_stream, tc.batch_size, tc.seq_len + 1, gen)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        meter.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.autocast_bf16):
            main, mtp = losses(model, window)
        loss = main + tc.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        with torch.no_grad():
            for name, router in meter.routers.items():
                update_bias(router.e_score_correction_bias, meter.counts[name], tc.bias_update_speed)
        tokens += window[:, :-1].numel()
        elapsed = time.perf_counter() - t0
        loads = [c.float() for c in meter.counts.values()]
        entry = {"step": step + 1, "loss": main.item(), "mtp_loss": mtp.item(), "lr": lr_at(step, tc),
                 "grad_norm": float(gnorm), "tokens": tokens, "elapsed_s": round(elapsed, 2),
                 "max_over_mean_load": max((l.max() / l.mean()).item() for l in loads)}
        if held is not None and ((step + 1) % tc.eval_every == 0 or step + 1 == tc.steps):
            entry["heldout_loss"], entry["heldout_mtp_loss"] = heldout_loss(model, held)
        log.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", mtp=f"{entry['mtp_loss']:.3f}",
                        tok_s=f"{tokens / elapsed:.0f}", refresh=False)
        if on_checkpoint is not None and ((step + 1) % tc.save_every == 0 or step + 1 == tc.steps):
            on_checkpoint(step + 1, log)
    meter.remove()
    model.eval()
    return log


def build_corpus(vocab_size: int):
    """(tokenizer, train stream, held-out stream): files as [bos] tokens [eos], concatenated."""
    from matrixinfer.train.corpus import read_texts, split
    from matrixinfer.train.tokenizer import encode_documents, train_tokenizer

    train_files, held_files = split()
    train_texts = read_texts(train_files)
    tok = train_tokenizer(train_texts, vocab_size)
    train_stream = token_stream(encode_documents(tok, train_texts))
    held_stream = token_stream(encode_documents(tok, read_texts(held_files)))
    return tok, train_stream, held_stream, train_files, held_files


def token_stream(docs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([i for d in docs for i in d], dtype=torch.long)


def run(out_dir: Path, tc: TrainConfig, vocab_size: int = 4096, arch_overrides: dict | None = None) -> None:
    """The full recipe: tokenizer, model, training with periodic checkpoints into out_dir."""
    from matrixinfer.train.tokenizer import save_tokenizer

    torch.set_num_threads(tc.threads)
    out_dir = Path(out_dir)
    tok, train_stream, held_stream, train_files, held_files = build_corpus(vocab_size)
    cfg = hf_config(tok.get_vocab_size(), **(arch_overrides or {}))
    model = build_model(cfg, tc.seed)
    print(f"corpus: {len(train_files)} train files ({len(train_stream)} tokens), {len(held_files)} held-out "
          f"files ({len(held_stream)} tokens); model: {count_params(model) / 1e6:.2f}M parameters", flush=True)
    save_tokenizer(tok, out_dir, model_max_length=cfg["max_position_embeddings"])
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "pad_token_id": cfg["pad_token_id"], "do_sample": False}, indent=2) + "\n")

    def checkpoint(step: int, log: list[dict]) -> None:
        save_pretrained(model, out_dir, cfg)
        meta = {"train_config": asdict(tc), "vocab_size": tok.get_vocab_size(), "completed_steps": step,
                "train_tokens": int(train_stream.numel()), "heldout_tokens": int(held_stream.numel()),
                "torch": torch.__version__, "log": log}
        (out_dir / "training_log.json").write_text(json.dumps(meta) + "\n")
        model.train()

    train(model, train_stream, tc, held_stream, on_checkpoint=checkpoint)
