"""`matrixinfer generate` and `matrixinfer bench engine`."""

from __future__ import annotations

import os
import sys

from matrixinfer.config import DEFAULT_MODEL, EngineConfig


def _generate(args) -> int:
    from matrixinfer import LLM, SamplingParams

    llm = LLM(engine_config=EngineConfig.from_cli(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                            ignore_eos=args.ignore_eos)
    if args.stream:
        printed = ""
        for out in llm.generate_stream(args.prompt, params):
            text = out.outputs[0].text
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
        print()
        return 0
    out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(args.prompt + out.outputs[0].text)
    return 0


def _bench_engine(args) -> int:
    if args.quantization == "int8":
        from matrixinfer.bench.quant_bench import cmd_bench_engine_int8

        return cmd_bench_engine_int8(args)
    if args.batch_invariant:
        from matrixinfer.bench.invariance_bench import main

        return main(args)
    from matrixinfer.bench.engine_bench import main

    return main(args)


def register(sub, bench_sub) -> None:
    g = sub.add_parser("generate", help="generate a completion of one prompt")
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    EngineConfig.add_cli_args(g)
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.set_defaults(func=_generate)

    b = bench_sub.add_parser("engine", help="our engine vs transformers generate on the same requests")
    b.add_argument("--model", default=DEFAULT_MODEL)
    b.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32],
                   help="concurrent requests; several values run one after another")
    b.add_argument("--input-len", type=int, nargs="+", default=[128, 512],
                   help="prompt lengths; paired with --output-len, each pair run at every --requests")
    b.add_argument("--output-len", type=int, nargs="+", default=[128, 256])
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    b.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved; medians reported")
    b.add_argument("--max-num-seqs", type=int, default=64,
                   help="our engine's limits (raised to fit the requests), which size its compile warm-up as "
                        "serve's do: decode batch sizes up to this")
    b.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="and prefill token counts up to this (at least 4 prompts' worth)")
    b.add_argument("--no-profile", action="store_true")
    b.add_argument("--no-write", action="store_true", help="do not write benchmarks/")
    b.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    b.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: INT8 W8A8 vs BF16 on the same requests instead (decode tok/s, weight memory)")
    b.add_argument("--int8-model", default=None, help="with --quantization int8: the INT8 checkpoint "
                                                      "(default: `matrixinfer quantize` of --model into a temp dir)")
    b.add_argument("--batch-invariant", action="store_true",
                   help="the batch-invariant mode vs the default instead, same requests (step time, tok/s, and "
                        "whether each request's batched tokens equal its solo run's)")
    b.add_argument("--peers", default=None, metavar="DIR",
                   help="also run the CPU peers found in DIR (venv_llama/, venv_vllm/, a llama.cpp source for the "
                        "GGUF converter; the layout of ../shared/peers), each in its own process, same requests")
    b.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python (a peer)")
    b.add_argument("--vllm-python", default=None, help="an interpreter with vLLM's CPU build (a peer)")
    b.add_argument("--llama-cpp-src", default=None, help="llama.cpp source tree whose converter makes the GGUF")
    b.add_argument("--peer-gguf", default=None, help="a GGUF of --model in --dtype for llama.cpp (skips converting)")
    b.add_argument("--name", default="engine", help="benchmarks/<name>.json, <name>.png and the BENCHMARKS.md section")
    b.set_defaults(func=_bench_engine)

    from matrixinfer.bench import ep_bench, executor_bench, kv_connector_bench, prefill_bench, spec_bench

    e = bench_sub.add_parser("executor", help="in-process vs multi-process executors (TP=1, TP=2), same requests")
    executor_bench.add_arguments(e)
    e.set_defaults(func=executor_bench.main)
    ep = bench_sub.add_parser("ep", help="expert parallelism: dispatch/combine bytes and latency (INT8 vs BF16), "
                              "EPLB imbalance, decode at EP 1/2, the EP320 projection")
    ep_bench.add_arguments(ep)
    ep.set_defaults(func=ep_bench.main)

    pf = bench_sub.add_parser("prefill", help="prefill parallelism: DP vs TP vs SP-TP-SP on heavy-tailed prompt "
                              "lengths (tokens/s, balance, communication, memory), the 16-die projection")
    prefill_bench.add_arguments(pf)
    pf.set_defaults(func=prefill_bench.main)

    sp = bench_sub.add_parser("spec", help="the same requests with and without MTP speculative decoding")
    spec_bench.add_arguments(sp)
    sp.set_defaults(func=spec_bench.main)

    k = bench_sub.add_parser("kv-connector", help="EMS page layout (per block vs per layer) and TTFT from EMS vs recompute")
    kv_connector_bench.add_arguments(k)
    k.set_defaults(func=kv_connector_bench.main)
