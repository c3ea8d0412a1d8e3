"""vLLM (its CPU build) through its offline `LLM.generate` on token-id prompts: greedy,
ignore_eos, exactly output_len tokens, one call for all requests after a warm-up call of the
same shape. Job (stdin JSON): model, dtype, prompts, warm_prompts, output_len, hf_overrides.
Prints {"engine", "seconds", "tokens"}."""

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    import vllm
    from vllm import LLM, SamplingParams

    width = max(len(p) for p in job["prompts"])
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=width + job["output_len"] + 16,
              max_num_seqs=max(1, len(job["prompts"])), enable_prefix_caching=False,
              hf_overrides=job.get("hf_overrides") or None)
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], min_tokens=job["output_len"],
                            ignore_eos=True)

    def generate(ps):
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start

    generate(job["warm_prompts"])
    tokens, seconds = generate(job["prompts"])
    print(json.dumps({"engine": f"vLLM {vllm.__version__}", "seconds": seconds, "tokens": tokens}))


if __name__ == "__main__":
    main()
