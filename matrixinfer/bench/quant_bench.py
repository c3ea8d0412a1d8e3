"""`matrixinfer bench quant` (accuracy ablation of the INT8 techniques) and `matrixinfer bench
int8-gemm` (INT8 vs BF16 GEMM at DeepSeek-V3's shapes on this machine).

The ablation writes each variant's checkpoint with the quantizer and scores it through the
public API (prompt_logprobs, float32 compute): held-out perplexity and next-token top-1 of the
bundled model, and greedy agreement with the float checkpoint over 64 tokens. Then the same
variants on a random DeepSeek-V3-style model whose activations carry injected outlier
channels (x100), where the float function is unchanged (the norms are scaled up by 100 and
the weights reading them down by 100, the inverse of smoothing), so only quantization can
suffer from them: relative logits error, KL and top-1 agreement against the float model.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

VARIANTS = {  # name -> QuantizeOptions fields; None: the float model
    "bf16 (float)": None,
    "naive per-tensor": dict(naive=True),
    "per-channel / per-token": dict(smooth_alpha=None, scale_search=False, clip="none"),
    "+ smoothing": dict(smooth_alpha="search", scale_search=False, clip="none"),
    "+ scale search": dict(smooth_alpha=None, scale_search=True, clip="none"),
    "+ block clip (GPTQ)": dict(smooth_alpha=None, scale_search=False, clip="block"),
    "all": dict(smooth_alpha="search", scale_search=True, clip="block"),
}

# (name, K, N) of DeepSeek-V3's big matmuls: x [M, K] @ W^T [K, N]
GEMM_SHAPES = [("q_a|kv_a", 7168, 1536 + 576), ("q_b", 1536, 128 * 192), ("o_proj", 128 * 128, 7168),
               ("expert gate|up", 7168, 2 * 2048), ("expert down", 2048, 7168)]


def api_scores(model_dir, windows: torch.Tensor, prompts: torch.Tensor, steps: int) -> dict:
    """Score a checkpoint through the public API, as lm-eval-harness drives vLLM: held-out
    perplexity and next-token top-1 from SamplingParams(prompt_logprobs=1) (the prompt token's
    logprob and the most likely token at every position), and greedy continuations."""
    from matrixinfer import LLM, SamplingParams

    with LLM(model=str(model_dir), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        greedy = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts],
                              SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    nll, targets, top1 = 0.0, [], []
    for o in outs:
        for tok, entry in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]):
            nll -= entry[tok].logprob
            targets.append(tok)
            top1.append(min(entry.values(), key=lambda lp: lp.rank).token_id)
    top1_t = torch.tensor(top1)
    return {"perplexity": math.exp(nll / len(targets)), "top1": (top1_t == torch.tensor(targets)).float().mean().item(),
            "top1_ids": top1_t, "greedy": torch.tensor([o.outputs[0].token_ids for o in greedy])}


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean fraction of the greedy continuation that matches before the first divergence."""
    same = (a == b).int().cumprod(dim=1)
    return same.float().mean().item()


def ablation(model_dir: Path, work: Path, calib: torch.Tensor, windows: torch.Tensor, prompts: torch.Tensor,
             steps: int = 64) -> list[dict]:
    """Each variant: `matrixinfer quantize` with its flags into work/, then scored through
    LLM(model=...) (the float row is the source checkpoint itself). One row per variant."""
    from matrixinfer.quant.cli import quantize_checkpoint
    from matrixinfer.quant.quantize import QuantizeOptions

    rows, ref = [], None
    for i, (name, fields) in enumerate(VARIANTS.items()):
        t0 = time.perf_counter()
        ckpt = model_dir
        if fields is not None:
            ckpt = work / f"variant{i}"
            quantize_checkpoint(model_dir, ckpt, QuantizeOptions(**fields), calib, show_progress=False)
        sc = api_scores(ckpt, windows, prompts, steps)
        ref = ref or sc
        rows.append({"variant": name, "perplexity": sc["perplexity"], "top1": sc["top1"],
                     "top1_agree_float": (sc["top1_ids"] == ref["top1_ids"]).float().mean().item(),
                     f"greedy{steps}_agree": _agreement(sc["greedy"], ref["greedy"]),
                     "seconds": time.perf_counter() - t0})
        print(f"{name:26s} ppl {sc['perplexity']:9.4f} top1 {sc['top1']:.4f} "
              f"greedy {rows[-1][f'greedy{steps}_agree']:.3f}", flush=True)
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_vs_float_pct"] = 100 * (r["perplexity"] / base - 1)
    return rows


def outlier_model(seed: int = 0, factor: float = 100.0, n_outliers: int = 4, head_scale: float = 1.0):
    """A random DeepSeek-V3-style model (MLA with q_lora, 1 dense + 2 MoE layers, 16 experts
    top-4, 1 shared) whose normed activations carry `n_outliers` channels x factor.
    head_scale > 1 sharpens its next-token distributions (x4: logits' std about 4, the top
    token's probability about 0.46 instead of 0.03), so that top-1 agreement means something."""
    from matrixinfer.config import ModelConfig
    from matrixinfer.model.deepseek import DeepseekForCausalLM

    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_shared_experts=1,
                      n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, torch_dtype="float32")
    torch.manual_seed(seed)
    model = DeepseekForCausalLM(cfg, with_mtp=False).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * 0.1)
        hot = torch.randperm(cfg.hidden_size)[:n_outliers]
        for layer in model.model.layers:  # norm output x factor on `hot`, readers / factor: same function
            layer.input_layernorm.weight[hot] *= factor
            layer.post_attention_layernorm.weight[hot] *= factor
            for m in (layer.self_attn.fused_qkv_a_proj, getattr(layer.mlp, "gate_up_proj", None),
                      getattr(layer.mlp, "shared_experts", None) and layer.mlp.shared_experts.gate_up_proj,
                      getattr(layer.mlp, "gate", None)):
                if m is not None:
                    m.weight[:, hot] /= factor
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.w13_weight[:, :, hot] /= factor
        model.lm_head.weight.mul_(head_scale)
    return model


@torch.no_grad()
def outlier_ablation(base, calib: torch.Tensor, ids: torch.Tensor) -> list[dict]:
    """Each variant against the float model on the same tokens: mean relative logits error
    |l_q - l_f| / |l_f| per position, KL(float || quantized) per position, top-1 agreement."""
    import copy

    from matrixinfer.quant.calibrate import collect_stats
    from matrixinfer.quant.quantize import QuantizeOptions, quantize_model

    def logits(m):
        return m.compute_logits(m(ids, torch.arange(ids.shape[1]).expand_as(ids))).float()

    ref = logits(base)
    ref_lp = ref.log_softmax(-1)
    rows = []
    for name, fields in VARIANTS.items():
        model = copy.deepcopy(base)
        if fields is not None:
            model, _ = quantize_model(model, collect_stats(model, calib.split(8)), QuantizeOptions(**fields))
        got = logits(model)
        rows.append({"variant": name, "rel_logits_error": ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item(),
                     "kl_to_float": F.kl_div(got.log_softmax(-1), ref_lp, log_target=True, reduction="none")
                     .sum(-1).mean().item(),
                     "top1_agree_float": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()})
        print(f"{name:26s} rel {rows[-1]['rel_logits_error']:.4f} KL {rows[-1]['kl_to_float']:.4f} "
              f"top-1 {rows[-1]['top1_agree_float']:.3f}", flush=True)
    return rows


def cmd_bench_quant(args) -> int:
    import tempfile

    from matrixinfer.bench.report import markdown_table, save_json, write_section
    from matrixinfer.config import DEFAULT_MODEL
    from matrixinfer.quant.cli import calibration_windows
    from matrixinfer.train.evaluate import streams
    from matrixinfer.train.tiny import eval_windows

    torch.manual_seed(0)
    model_dir = Path(args.model or DEFAULT_MODEL)
    calib = calibration_windows(model_dir, args.num_samples, 256)
    _, held, _ = streams(model_dir)
    windows = eval_windows(held, 257, limit=args.windows)
    prompts = windows[:args.prompts, :32]
    print(f"== {model_dir.name}: {len(windows)} held-out windows of 256 scored tokens, through LLM(...) "
          "with prompt_logprobs")
    with tempfile.TemporaryDirectory(prefix="mi-ablation-") as work:
        tiny = ablation(model_dir, Path(work), calib, windows, prompts, args.steps)
    g = torch.Generator().manual_seed(1)
    r_calib, r_ids = torch.randint(0, 512, (16, 128), generator=g), torch.randint(0, 512, (16, 128), generator=g)
    print("== random DeepSeek-V3-style model, 4 activation channels x100, LM head x4; against the float model")
    outl = outlier_ablation(outlier_model(head_scale=4.0), r_calib, r_ids)
    outl_flat = outlier_ablation(outlier_model(factor=1.0, head_scale=4.0), r_calib, r_ids)
    data = {"model": str(model_dir.name), "heldout_windows": len(windows), "calibration_windows": list(calib.shape),
            "scored_through": "LLM.generate(SamplingParams(max_tokens=1, prompt_logprobs=1)), float32 compute",
            "tiny": tiny, "outliers": outl, "no_outliers": outl_flat}
    save_json("quant_ablation", data)
    head = ["variant", "perplexity", "ppl vs float %", "top-1", "top-1 = float", f"greedy-{args.steps} agree"]
    tab = markdown_table(head, [[r["variant"], r["perplexity"], r["ppl_vs_float_pct"], r["top1"], r["top1_agree_float"],
                                 r[f"greedy{args.steps}_agree"]] for r in tiny])
    head2 = ["variant", "rel. logits error", "KL to float", "top-1 = float", "rel. error, no outliers",
             "KL, no outliers"]
    tab2 = markdown_table(head2, [[r["variant"], r["rel_logits_error"], r["kl_to_float"], r["top1_agree_float"],
                                   f["rel_logits_error"], f["kl_to_float"]] for r, f in zip(outl, outl_flat)])
    _plot_ablation(tiny, outl, outl_flat)
    write_section("quant_ablation", "## INT8 W8A8 ablation (`matrixinfer bench quant`)\n\n"
                  f"Bundled model ({model_dir.name}): each variant is written by `matrixinfer quantize` with its "
                  f"flags and scored through the public API, `LLM(model=...).generate(windows, "
                  f"SamplingParams(max_tokens=1, prompt_logprobs=1))`, float32 compute: {len(windows)} held-out "
                  f"windows of 256 scored tokens; greedy agreement = mean matched prefix of {args.steps} greedy "
                  f"tokens on {args.prompts} held-out prompts.\n\n{tab}\n\n"
                  "Random DeepSeek-V3-style model (3 layers, 16 experts top-4 + 1 shared, MLA with q_lora), 4 "
                  "activation channels x100 injected into every norm's output with the readers' weights / 100 "
                  "(float function unchanged), LM head x4 so that its next-token distributions are peaked (top "
                  "token about 0.46); each variant against the float model on 16 x 128 random tokens, per "
                  "position: relative logits error, KL(float || INT8), top-1 agreement; the last two columns are "
                  "the same model without the outliers (what INT8 costs on this random model anyway).\n\n"
                  f"{tab2}\n\n![ablation](quant_ablation.png)\n")
    return 0


def _plot_ablation(tiny, outl, outl_flat):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matrixinfer.bench.report import bench_dir

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["variant"] for r in tiny]
    axes[0].barh(names, [r["ppl_vs_float_pct"] for r in tiny])
    axes[0].set_xlabel("held-out perplexity vs float (%)")
    axes[0].set_title("bundled model")
    axes[1].barh(names, [r["rel_logits_error"] for r in outl], label="outliers x100")
    axes[1].barh(names, [r["rel_logits_error"] for r in outl_flat], height=0.4, label="no outliers")
    axes[1].set_xlabel("relative logits error vs float")
    axes[1].set_title("random V3 config")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(bench_dir() / "quant_ablation.png", dpi=110)
    plt.close(fig)


def cpu_path() -> dict:
    from matrixinfer.kernels import cpu_flags

    flags = cpu_flags()
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "amx_int8": "amx_int8" in flags, "amx_bf16": "amx_bf16" in flags,
            "avx512_vnni": "avx512_vnni" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "threads": torch.get_num_threads()}


def _time_pair(fa, fb, reps: int) -> tuple[float, float]:
    """Medians of reps runs of fa and fb, interleaved (a, b, b, a, ...) so that other processes'
    bursts on shared CPUs fall on both sides alike; one warm-up each."""
    fa(), fb()
    ta, tb = [], []
    for i in range(reps):
        for f, ts in ((fa, ta), (fb, tb)) if i % 2 == 0 else ((fb, tb), (fa, ta)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return sorted(ta)[reps // 2], sorted(tb)[reps // 2]


def gemm_rows(device: str, batches: list[int], reps: int) -> list[dict]:
    from matrixinfer.quant.int8 import int8_linear, quantize_weight

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for name, k, n in GEMM_SHAPES:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        wq, ws = quantize_weight(w)
        wt, st = wq.t(), ws.t()
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16, int8 = _time_pair(lambda: (F.linear(x, w), sync()),
                                    lambda: (int8_linear(x, wt, st), sync()), reps)  # incl. activation quantization
            rows.append({"op": name, "K": k, "N": n, "M": m, "bf16_ms": bf16 * 1e3, "int8_ms": int8 * 1e3,
                         "speedup": bf16 / int8})
            print(f"{name:15s} M={m:4d} bf16 {bf16 * 1e3:8.3f} ms  int8 {int8 * 1e3:8.3f} ms  x{bf16 / int8:.2f}",
                  flush=True)
        del w, wq
    return rows


def cmd_bench_gemm(args) -> int:
    from matrixinfer.bench.report import markdown_table, save_json, write_section

    batches = [int(b) for b in args.batches.split(",")]
    path = cpu_path() if args.device == "cpu" else {"cuda": torch.cuda.get_device_name()}
    print(path)
    rows = gemm_rows(args.device, batches, args.reps)
    name = f"int8_gemm_{args.device.split(':')[0]}"
    save_json(name, {"path": path, "rows": rows})
    tab = markdown_table(["op (K x N)", "M tokens", "BF16 ms", "INT8 ms", "INT8 speed-up"],
                         [[f"{r['op']} ({r['K']}x{r['N']})", r["M"], r["bf16_ms"], r["int8_ms"], r["speedup"]]
                          for r in rows])
    _plot_gemm(rows, name)
    write_section(name, f"## INT8 vs BF16 GEMM, DeepSeek-V3 shapes, {args.device} (`matrixinfer bench int8-gemm`)\n\n"
                  f"Path: `{path}`. INT8 time includes the per-token activation quantization and the scale "
                  f"epilogue. Median of {args.reps} runs of each side, interleaved.\n\n{tab}\n\n![gemm]({name}.png)\n")
    return 0


def _plot_gemm(rows, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matrixinfer.bench.report import bench_dir

    fig, ax = plt.subplots(figsize=(7, 4))
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        ax.plot([r["M"] for r in rs], [r["speedup"] for r in rs], marker="o", label=op)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.5, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens M")
    ax.set_ylabel("INT8 speed-up over BF16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(bench_dir() / f"{name}.png", dpi=110)
    plt.close(fig)


def register(bench_sub) -> None:
    p = bench_sub.add_parser("quant", help="INT8 ablation: naive, per-channel/per-token, smoothing, scale search, "
                                           "block clipping, all (bundled model + random V3 with outliers)")
    p.add_argument("--model", default=None)
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows of 256 tokens")
    p.add_argument("--windows", type=int, default=64, help="held-out windows of 256 scored tokens")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--steps", type=int, default=64)
    p.set_defaults(func=cmd_bench_quant)
    g = bench_sub.add_parser("int8-gemm", help="INT8 vs BF16 GEMM at DeepSeek-V3 shapes")
    g.add_argument("--device", default="cpu")
    g.add_argument("--batches", default="1,8,32,128,256")
    g.add_argument("--reps", type=int, default=21, help="timed runs of each side, interleaved; medians reported")
    g.set_defaults(func=cmd_bench_gemm)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def engine_rows(float_dir: str, int8_dir: str, requests: list[int], input_len: int, output_len: int,
                repeats: int, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> list[dict]:
    """BF16 (the float checkpoint at dtype bfloat16) vs the INT8 checkpoint (its float layers in
    bfloat16) on the same greedy requests: decode tokens/s from the median all-decode step,
    `repeats` runs of each interleaved."""
    from matrixinfer.bench.engine_bench import _median, _requests, run_matrixinfer
    from matrixinfer.config import ModelConfig

    prompts_all = _requests(max(requests), input_len, ModelConfig.from_pretrained(float_dir).vocab_size)
    rows = []
    for n in requests:
        steps: dict[str, list[float]] = {"bf16": [], "int8": []}
        mem = {}
        for _ in range(repeats):
            for name, ckpt in (("bf16", float_dir), ("int8", int8_dir)):
                mi = run_matrixinfer(ckpt, "bfloat16", prompts_all[:n], output_len, False, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens)
                steps[name].append(mi.decode_step_s)
                mem[name] = _weight_bytes(mi.llm.engine.model)
                mi.llm.shutdown()
        bf16, int8 = _median(steps["bf16"]), _median(steps["int8"])
        rows.append({"requests": n, "bf16_decode_tok_s": n / bf16, "int8_decode_tok_s": n / int8,
                     "bf16_step_ms": bf16 * 1e3, "int8_step_ms": int8 * 1e3, "speedup": bf16 / int8,
                     "bf16_weight_mb": mem["bf16"] / 1e6, "int8_weight_mb": mem["int8"] / 1e6})
        print(f"{n:3d} seqs: bf16 {n / bf16:8.1f} tok/s ({bf16 * 1e3:.2f} ms/step)  int8 {n / int8:8.1f} tok/s "
              f"({int8 * 1e3:.2f} ms/step)  x{bf16 / int8:.2f}", flush=True)
    return rows


def cmd_bench_engine_int8(args) -> int:
    """`matrixinfer bench engine --quantization int8`."""
    import tempfile

    from matrixinfer.bench.report import markdown_table, save_json, write_section
    from matrixinfer.quant.cli import calibration_windows, quantize_checkpoint
    from matrixinfer.quant.quantize import QuantizeOptions

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="mi-int8-") as work:
        int8_dir = args.int8_model
        if int8_dir is None:
            int8_dir = str(Path(work) / "int8")
            quantize_checkpoint(Path(args.model), int8_dir, QuantizeOptions(),
                                calibration_windows(Path(args.model), 16, 256), show_progress=False)
        rows = engine_rows(str(args.model), int8_dir, args.requests, args.input_len[0], args.output_len[0],
                           args.repeats, args.max_num_seqs, args.max_num_batched_tokens)
    path = cpu_path()
    save_json("engine_int8", {"model": str(args.model), "threads": args.threads, "path": path,
                              "input_len": args.input_len[0], "output_len": args.output_len[0], "rows": rows})
    tab = markdown_table(["sequences", "BF16 decode tok/s", "INT8 decode tok/s", "BF16 step ms", "INT8 step ms",
                          "INT8 speed-up", "BF16 weights MB", "INT8 weights MB"],
                         [[r["requests"], r["bf16_decode_tok_s"], r["int8_decode_tok_s"], r["bf16_step_ms"],
                           r["int8_step_ms"], r["speedup"], r["bf16_weight_mb"], r["int8_weight_mb"]] for r in rows])
    write_section("engine_int8", "## Engine: INT8 W8A8 vs BF16 (`matrixinfer bench engine --quantization int8`)\n\n"
                  f"`{args.model}` at dtype bfloat16 vs its `matrixinfer quantize` checkpoint (INT8 linears and "
                  f"experts, the rest bfloat16), the same greedy requests ({args.input_len[0]} prompt + "
                  f"{args.output_len[0]} output tokens), {args.threads} CPU threads, decode tokens/s from the median "
                  f"all-decode step of {args.repeats} interleaved runs. Path: `{path}`.\n\n{tab}\n\n"
                  "On this tiny model (hidden 256) a decode step is per-operator overhead, not weight reads or "
                  "matmul work: the INT8 path adds a per-token activation quantization and a scale epilogue per "
                  "linear, which costs as much as it saves. The GEMM-level comparison at DeepSeek-V3's shapes is "
                  "the `int8_gemm_cpu` section.\n")
    return 0
