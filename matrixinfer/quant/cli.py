"""`matrixinfer quantize`: calibrate a float checkpoint on text and write its W8A8 INT8
checkpoint (compressed-tensors layout) that `LLM(model=OUT)` and `matrixinfer serve` load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def calibration_windows(model_dir: Path, num_samples: int, seq_len: int, calib_data: str | None = None) -> torch.Tensor:
    """[num_samples, seq_len] token ids: from a text file, or by default from the training
    split of the bundled model's corpus (train/corpus.py), which is disjoint from the
    held-out files the ablation scores."""
    from tokenizers import Tokenizer

    from matrixinfer.train.corpus import read_texts, split
    from matrixinfer.train.tiny import eval_windows, token_stream

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if calib_data:
        texts = [Path(calib_data).read_text(encoding="utf-8", errors="replace")]
    else:
        train_files, _ = split()
        step = max(1, len(train_files) // (4 * num_samples))  # files spread over the whole split
        texts = read_texts(train_files[::step])
    windows = eval_windows(token_stream([e.ids for e in tok.encode_batch(texts)]), seq_len)
    if len(windows) < num_samples:
        raise ValueError(f"calibration text gives {len(windows)} windows of {seq_len} tokens, {num_samples} asked")
    pick = torch.linspace(0, len(windows) - 1, num_samples).long()
    return windows[pick]


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, opts, windows: torch.Tensor,
                        batch_size: int = 8, show_progress: bool = True, stream: bool = False) -> dict:
    """Load, calibrate, quantize, save (stream: one decoder layer at a time, resumable,
    stream.py). Returns a summary (also written as quantize.json)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if stream:
        from matrixinfer.quant.stream import quantize_streaming

        quantize_streaming(model_dir, out_dir, opts, windows, batch_size, show_progress)
    else:
        _quantize_in_memory(model_dir, out_dir, opts, windows, batch_size, show_progress)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)
    summary = {"source": str(model_dir), "calibration_windows": list(windows.shape), "streamed": stream,
               "options": {k: getattr(opts, k) for k in ("naive", "smooth_alpha", "scale_search", "clip", "block_size")}}
    (out_dir / "quantize.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _quantize_in_memory(model_dir: Path, out_dir: Path, opts, windows: torch.Tensor, batch_size: int,
                        show_progress: bool) -> None:
    from tqdm import tqdm

    from matrixinfer.model.loader import load_model
    from matrixinfer.model.saver import save_pretrained
    from matrixinfer.quant.calibrate import collect_stats
    from matrixinfer.quant.compressed_tensors import config_to_dict
    from matrixinfer.quant.quantize import default_ignore, num_quantized_modules, quantize_model

    model = load_model(model_dir, dtype="float32", quant_config=None)
    batches = windows.split(batch_size)
    with tqdm(total=len(batches), desc="calibrate", unit="batch", disable=not show_progress) as bar:
        stats = collect_stats(model, batches, progress=bar)
    ignore = default_ignore(model.config.num_hidden_layers, len(model.model.mtp))
    with tqdm(total=num_quantized_modules(model, ignore), desc="quantize", unit="layer",
              disable=not show_progress) as bar:
        qmodel, ignore = quantize_model(model, stats, opts, ignore, progress=bar)
    hf = json.loads((model_dir / "config.json").read_text())
    hf["quantization_config"] = config_to_dict(ignore, "channel", opts.act_strategy)
    save_pretrained(qmodel, out_dir, hf, dtype=torch.bfloat16)


def _alpha(value: str):
    if value in ("off", "none"):
        return None
    return value if value == "search" else float(value)


def cmd_quantize(args) -> int:
    from matrixinfer.quant.quantize import QuantizeOptions

    torch.manual_seed(0)
    opts = QuantizeOptions(naive=args.naive, smooth_alpha=_alpha(args.smooth_alpha),
                           scale_search=args.scale_search == "on", clip=args.clip, block_size=args.block_size)
    model_dir = Path(args.model)
    windows = calibration_windows(model_dir, args.num_samples, args.seq_len, args.calib_data)
    quantize_checkpoint(model_dir, args.out, opts, windows, stream=args.stream)
    print(f"wrote {args.out} (W8A8 int8, compressed-tensors layout)")
    return 0


def register(sub, bench_sub) -> None:
    from matrixinfer.config import DEFAULT_MODEL

    p = sub.add_parser("quantize", help="W8A8 INT8 without retraining: calibrate and write a compressed-tensors "
                                        "int8 checkpoint")
    p.add_argument("--model", default=DEFAULT_MODEL, help="float checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--calib-data", default=None, help="a text file (default: the corpus' training split)")
    p.add_argument("--num-samples", type=int, default=64, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--smooth-alpha", default="search", help="SmoothQuant strength: a number, 'search' or 'off'")
    p.add_argument("--scale-search", default="on", choices=["on", "off"], help="per-channel clip-ratio search")
    p.add_argument("--clip", default="block", choices=["block", "none"],
                   help="block: block-wise GPTQ error compensation; none: round to nearest")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--naive", action="store_true", help="per-tensor min-max weights and activations (baseline)")
    p.add_argument("--stream", action="store_true",
                   help="one decoder layer in memory at a time (the same output), resumable: rerun after a kill")
    p.set_defaults(func=cmd_quantize)
