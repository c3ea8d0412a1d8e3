"""llama.cpp through llama-cpp-python's low-level batched API: all requests' prompts in one
llama_decode, then one llama_decode per step for every sequence, greedy (argmax of each row's
logits), no EOS. Job (stdin JSON): gguf, prompts, warm_prompts, output_len, threads, vocab.
Prints {"engine", "seconds", "prefill_seconds", "tokens"}."""

import json
import sys
import time

import llama_cpp as L
import numpy as np


def main() -> None:
    job = json.load(sys.stdin)
    prompts, n_out, vocab = job["prompts"], job["output_len"], job["vocab"]
    n_seq, width = len(prompts), max(len(p) for p in prompts)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(job["gguf"].encode(), L.llama_model_default_params())
    if model is None:
        raise SystemExit(f"llama.cpp could not load {job['gguf']}")
    cp = L.llama_context_default_params()
    cp.n_ctx = (width + n_out) * n_seq
    cp.n_seq_max = n_seq
    cp.n_batch = max(512, width * n_seq)
    cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(max(512, width * n_seq), 0, n_seq)

    def fill(items):
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits

    def argmax(i: int) -> int:
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())

    def generate(ps):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        start = time.perf_counter()
        items, last = [], []
        for s, p in enumerate(ps):
            items += [(tok, pos, s, pos == len(p) - 1) for pos, tok in enumerate(p)]
            last.append(len(items) - 1)
        fill(items)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed on the prompts")
        nxt = [argmax(i) for i in last]
        prefill = time.perf_counter() - start
        outs = [[t] for t in nxt]
        for step in range(1, n_out):
            fill([(nxt[s], len(ps[s]) + step - 1, s, True) for s in range(len(ps))])
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed in a decode step")
            nxt = [argmax(s) for s in range(len(ps))]
            for s in range(len(ps)):
                outs[s].append(nxt[s])
        return outs, time.perf_counter() - start, prefill

    generate(job["warm_prompts"])
    outs, seconds, prefill = generate(prompts)
    print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {L.__version__})", "seconds": seconds,
                      "prefill_seconds": prefill, "tokens": outs}))
    L.llama_batch_free(batch)
    L.llama_free(ctx)


if __name__ == "__main__":
    main()
