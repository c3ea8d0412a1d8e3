"""Held-out evaluation of the tiny model and its model card.

Everything in the card is computed here from the checkpoint as shipped (bf16 weights, run in
float32): perplexity vs a unigram model over the same tokenizer, MTP next-next-token top-1
accuracy, expert load balance per MoE layer, a greedy continuation checked against
transformers' DeepseekV3ForCausalLM, and the training curve from training_log.json.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from matrixinfer.model.loader import load_model
from matrixinfer.train.tiny import LoadMeter, count_params, eval_windows, token_stream

SAMPLE_PROMPT = "import os\n\n\ndef read_lines(path):"


def streams(model_dir: Path):
    """(train stream, held-out stream) tokenized with the shipped tokenizer."""
    from tokenizers import Tokenizer

    from matrixinfer.train.corpus import read_texts, split
    from matrixinfer.train.tokenizer import encode_documents

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_files, held_files = split()
    return (token_stream(encode_documents(tok, read_texts(train_files))),
            token_stream(encode_documents(tok, read_texts(held_files))), held_files)


def unigram_nll(train_stream: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Mean NLL of `targets` under add-one-smoothed token frequencies of the training split."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[targets].mean().item()


@torch.no_grad()
def heldout_metrics(model, windows: torch.Tensor, batch: int = 8) -> dict:
    meter = LoadMeter(model)
    nll = mtp_nll = 0.0
    n_main = n_mtp = correct = mtp_correct = 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        x, y = w[:, :-1], w[:, 1:]
        pos = torch.arange(x.shape[1]).expand_as(x)
        h = model(x, pos)
        logits = model.compute_logits(h).float()
        nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        n_main += y.numel()
        logits2 = model.compute_logits(model.mtp_forward(h[:, :-1], x[:, 1:], pos[:, 1:])).float()
        y2 = y[:, 1:]
        mtp_nll += F.cross_entropy(logits2.flatten(0, 1), y2.flatten(), reduction="sum").item()
        mtp_correct += (logits2.argmax(-1) == y2).sum().item()
        n_mtp += y2.numel()
    balance = {}
    for name, c in meter.counts.items():
        idx = int(name.split(".")[2])
        key = f"MTP (layer {model.config.num_hidden_layers + idx})" if ".mtp." in name else f"layer {idx}"
        c = c.float()
        balance[key] = {"max_over_mean": round((c.max() / c.mean()).item(), 3),
                        "min_over_mean": round((c.min() / c.mean()).item(), 3),
                        "tokens_per_expert": [int(v) for v in c.tolist()]}
    meter.remove()
    return {"nll": nll / n_main, "top1": correct / n_main, "mtp_nll": mtp_nll / n_mtp,
            "mtp_top1": mtp_correct / n_mtp, "scored_tokens": n_main, "mtp_scored_tokens": n_mtp,
            "expert_balance": balance}


@torch.no_grad()
def greedy_ours(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = []
    for _ in range(n):
        nxt = int(model.compute_logits(model(x, torch.arange(x.shape[1])[None]))[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def greedy_transformers(model_dir: Path, ids: list[int], n: int) -> list[int]:
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                       min_new_tokens=n)[0, len(ids):].tolist()


def plot_curve(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tok = [e["tokens"] / 1e6 for e in log]
    fig, ax = plt.subplots(figsize=(7, 4))
    k = 10  # running mean of the per-step training losses

    def smooth(v):
        return [sum(v[max(0, i - k + 1) : i + 1]) / len(v[max(0, i - k + 1) : i + 1]) for i in range(len(v))]

    ax.plot(tok, smooth([e["loss"] for e in log]), label="train loss (next token)")
    ax.plot(tok, smooth([e["mtp_loss"] for e in log]), label="train MTP loss (token after next)", alpha=0.8)
    ev = [e for e in log if "heldout_loss" in e]
    ax.plot([e["tokens"] / 1e6 for e in ev], [e["heldout_loss"] for e in ev], "o-", ms=3, label="held-out loss (subset)")
    ax.plot([e["tokens"] / 1e6 for e in ev], [e["heldout_mtp_loss"] for e in ev], "s--", ms=3, label="held-out MTP loss (subset)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("matrixinfer-tiny-moe training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate_and_write_card(model_dir: Path, threads: int = 2, max_windows: int | None = None) -> dict:
    from tokenizers import Tokenizer

    torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    meta = json.loads((model_dir / "training_log.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    tc = meta["train_config"]
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype="float32")
    train_stream, held_stream, held_files = streams(model_dir)
    windows = eval_windows(held_stream, tc["seq_len"] + 1, max_windows)
    m = heldout_metrics(model, windows)
    targets = windows[:, 1:].flatten()
    m["unigram_nll"] = unigram_nll(train_stream, targets, cfg["vocab_size"])
    m["perplexity"], m["unigram_perplexity"] = math.exp(m["nll"]), math.exp(m["unigram_nll"])
    m["mtp_perplexity"] = math.exp(m["mtp_nll"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt_ids = tok.encode(SAMPLE_PROMPT).ids
    ours = greedy_ours(model, prompt_ids, 32)
    theirs = greedy_transformers(model_dir, prompt_ids, 32)
    ours_long = greedy_ours(model, prompt_ids, 96)
    st = model_dir / "model.safetensors"
    result = {
        "heldout_files": len(held_files), "heldout_windows": len(windows), "window_tokens": tc["seq_len"],
        **m,
        "params": count_params(model), "params_in_checkpoint": _checkpoint_numel(st), "checkpoint_bytes": st.stat().st_size,
        "greedy_prompt": SAMPLE_PROMPT, "greedy_matrixinfer": ours, "greedy_transformers": theirs,
        "greedy_match": ours == theirs, "sample_continuation": tok.decode(ours_long),
        "eval_seconds": round(time.perf_counter() - t0, 1),
    }
    (model_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_curve(meta["log"], model_dir / "training_curve.png")
    distill = model_dir / "mtp_distill_log.json"
    card = model_card(cfg, meta, result)
    if distill.exists():
        card = card.replace("\n## Held-out results", distill_section(json.loads(distill.read_text())) + "\n## Held-out results")
    (model_dir / "README.md").write_text(card)
    print(json.dumps({k: v for k, v in result.items() if k not in ("expert_balance",)}, indent=1))
    return result


def distill_section(d: dict) -> str:
    """The model card's note on the self-distilled MTP module (`matrixinfer distill-mtp`)."""
    minutes = d["log"][-1]["elapsed_s"] / 60
    return f"""
## Self-distilled MTP module

After pretraining, the MTP module alone was trained for {d["steps"]} more steps (batch {d["batch_size"]} x
{d["seq_len"]} tokens, lr {d["lr"]} cosine to 10 %, {minutes:.0f} minutes; `matrixinfer distill-mtp`)
towards the main model's own next-next-token distribution instead of the corpus's (the main model
frozen: its tensors are bit-identical to before). Speculative decoding accepts a draft when it
matches the main model's choice, so this is what the module is for. Top-1 agreement with the main
model's next-next token on held-out text (teacher-forced): **{100 * d["before"]:.1f} % -> {100 * d["after"]:.1f} %**.
(The corpus-based MTP accuracy below measures the other target.){_engine_acceptance(d.get("engine_acceptance"))}
"""


def _engine_acceptance(a: dict | None) -> str:
    if not a:
        return ""
    rows = "\n".join(f"| {k} | {100 * v[0]:.1f} % | {100 * v[1]:.1f} % |" for k, v in a["rows"].items())
    return f"""

Acceptance in the engine ({a["how"]}), before and after:

| drafts per step | before | after |
| --- | --- | --- |
{rows}"""


def _checkpoint_numel(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def model_card(cfg: dict, meta: dict, r: dict) -> str:
    tc = meta["train_config"]
    log = meta["log"]
    last = log[-1]
    rows = [
        ("vocab_size", cfg["vocab_size"]), ("hidden_size", cfg["hidden_size"]),
        ("num_hidden_layers", f'{cfg["num_hidden_layers"]} (layer 0 dense, layers 1-{cfg["num_hidden_layers"] - 1} MoE)'),
        ("attention", f'MLA, {cfg["num_attention_heads"]} heads, q_lora_rank {cfg["q_lora_rank"]}, kv_lora_rank {cfg["kv_lora_rank"]}, '
                      f'qk_nope_head_dim {cfg["qk_nope_head_dim"]}, qk_rope_head_dim {cfg["qk_rope_head_dim"]}, v_head_dim {cfg["v_head_dim"]}'),
        ("dense FFN", f'SwiGLU, intermediate_size {cfg["intermediate_size"]}'),
        ("MoE", f'{cfg["n_routed_experts"]} routed experts (moe_intermediate_size {cfg["moe_intermediate_size"]}), top-{cfg["num_experts_per_tok"]}, '
                f'{cfg["n_shared_experts"]} shared expert'),
        ("routing", f'noaux_tc: sigmoid scores + e_score_correction_bias, {cfg["n_group"]} groups, topk_group {cfg["topk_group"]}, '
                    f'norm_topk_prob {cfg["norm_topk_prob"]}, routed_scaling_factor {cfg["routed_scaling_factor"]}'),
        ("MTP", f'{cfg["num_nextn_predict_layers"]} module (stored as model.layers.{cfg["num_hidden_layers"]}.*, MoE block), loss weight {tc["mtp_weight"]}'),
        ("RoPE", f'theta {cfg["rope_parameters"]["rope_theta"]}, interleaved; trained at {tc["seq_len"]} tokens, max_position_embeddings {cfg["max_position_embeddings"]}'),
        ("parameters", f'{r["params"] / 1e6:.2f}M unique ({r["params_in_checkpoint"] / 1e6:.2f}M stored: the MTP layer carries its copies of embedding and head)'),
        ("checkpoint", f'{r["checkpoint_bytes"] / 1e6:.1f} MB model.safetensors (bf16; router weights and correction bias float32)'),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    bal_rows = "\n".join(
        f'| {k} | {v["max_over_mean"]:.2f} | {v["min_over_mean"]:.2f} | {" ".join(str(t) for t in v["tokens_per_expert"])} |'
        for k, v in r["expert_balance"].items())
    minutes = last["elapsed_s"] / 60
    return f"""---
license: psf-2.0
library_name: matrixinfer
pipeline_tag: text-generation
tags: [deepseek_v3, moe, mla, mtp, code]
---

# matrixinfer-tiny-moe

A small model with the DeepSeek-V3 architecture (MLA, DeepSeekMoE with aux-loss-free
noaux_tc routing, one multi-token-prediction module), trained from scratch on the Python
standard library so that matrixinfer has real weights on a machine without internet. It
writes Python-looking code; it knows nothing else. It is the default `--model` of
matrixinfer and the model the tests use where trained weights matter.

Loads with matrixinfer (`matrixinfer.model.loader.load_model`) and with
`transformers.DeepseekV3ForCausalLM.from_pretrained` (which ignores the MTP layer).

Every number below is computed by `matrixinfer eval-tiny` (`matrixinfer/train/evaluate.py`)
from this checkpoint; the weights come from `matrixinfer train-tiny` (`matrixinfer/train/tiny.py`).

## Corpus

`Lib/**/*.py` of CPython 3.11 (the interpreter's `sysconfig.get_paths()["stdlib"]`), without
`test/`/`tests/` directories, `idlelib/`, `site-packages/` and generated `_sysconfigdata*`
files. Held-out split by file: the {r["heldout_files"]} files listed in `data/heldout_files.txt`
(about 4 %, chosen once by a hash of the path). Each file is one document, `<|bos|>` tokens
`<|eos|>`, concatenated. Training split: {meta["train_tokens"]:,} tokens; held-out: {meta["heldout_tokens"]:,} tokens.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training split, {cfg["vocab_size"]} tokens
including `<|bos|>` (0), `<|eos|>` (1), `<|pad|>` (2). Encoding adds `<|bos|>`.
`tokenizer_config.json` has a chat template that writes user/system turns as Python comments
(`# user: ...`) and opens the assistant turn with `# assistant:`, so chat requests work and
the reply is code.

## Architecture

| | |
| --- | --- |
{table}

## Training

{tc["steps"]} AdamW steps (betas 0.9/0.95, weight decay {tc["weight_decay"]}, peak lr {tc["lr"]},
{tc["warmup_steps"]} warmup steps then cosine to {tc["min_lr_ratio"]}x), batch {tc["batch_size"]} x {tc["seq_len"]}
tokens (random windows of the training stream drawn from a generator seeded with {tc["seed"]}),
gradient clipping {tc["grad_clip"]}, bf16 autocast = {tc["autocast_bf16"]} with float32 master
weights. Loss = next-token CE + {tc["mtp_weight"]} x MTP CE (the MTP module combines the final
hidden state h_i with the embedding of t_(i+1) and predicts t_(i+2)). The routing bias of each
MoE layer is updated after every step by the aux-loss-free rule
`bias += {tc["bias_update_speed"]} * sign(mean_load - load)` (no auxiliary loss; a first run with
DeepSeek-V3's 0.001 left one expert of the last MoE layer taking every token after 150 steps, too few
for the bias to catch up). Seen
{last["tokens"]:,} tokens in {minutes:.0f} minutes on {tc["threads"]} CPU thread(s) of a shared 2-core
machine (torch {meta["torch"]}).

![training curve](training_curve.png)

(Training losses: running mean over 10 steps. The held-out points during training score only the
first {tc["eval_windows"]} held-out windows; the table below scores all of them.)

## Held-out results

Scored on {r["heldout_windows"]} non-overlapping windows of {r["window_tokens"]} tokens over the held-out files
({r["scored_tokens"]:,} predicted tokens).

| metric | value |
| --- | --- |
| perplexity (next token) | **{r["perplexity"]:.2f}** |
| unigram perplexity (add-one token frequencies of the training split, same tokenizer, same tokens) | {r["unigram_perplexity"]:.1f} |
| next-token top-1 accuracy | {100 * r["top1"]:.1f} % |
| MTP next-next-token top-1 accuracy (MTP module given h_i and the true t_(i+1), predicting t_(i+2)) | **{100 * r["mtp_top1"]:.1f} %** |
| MTP next-next-token perplexity | {r["mtp_perplexity"]:.2f} |

Expert load balance on the held-out set (tokens routed to each of the {cfg["n_routed_experts"]} routed experts,
{cfg["num_experts_per_tok"]} per token; 1.00 is perfect balance):

| MoE layer | max/mean | min/mean | tokens per expert |
| --- | --- | --- | --- |
{bal_rows}

## Consistency with transformers

Greedy continuation of 32 tokens of the prompt `{SAMPLE_PROMPT!r}`: matrixinfer and
`transformers.DeepseekV3ForCausalLM` (float32) give {"the same tokens" if r["greedy_match"] else "DIFFERENT tokens"}.

Greedy sample (96 tokens, matrixinfer):

```python
{SAMPLE_PROMPT}{r["sample_continuation"]}
```

## Limitations

Trained for minutes on 11 MB of code: it imitates the look of the standard library, not its
meaning. Trained on windows of {tc["seq_len"]} tokens; quality beyond that length is untested.
License: the corpus is the Python standard library (PSF License).
"""
