import sys, time, torch, os
from matrixinfer import LLM, SamplingParams
from matrixinfer.engine.sampling_params import RequestOutputKind
from matrixinfer.model.context import forward_context
from matrixinfer.kernels import c_shims
from matrixinfer.worker.compiled_decode import _guards_to_keep
dtype = sys.argv[1]; T = int(sys.argv[2]); cppw = sys.argv[3] == "1"
torch.set_num_threads(2)
llm = LLM(dtype=dtype, max_num_seqs=64, max_num_batched_tokens=2048)
eng = llm.engine; runner = eng.worker.runner; m = runner.model
opts = {"cpp_wrapper": cppw, "size_asserts": False, "guard_filter_fn": _guards_to_keep}
if cppw: opts["aot_inductor.custom_ops_to_c_shims"] = c_shims()
comp = torch.compile(m.forward, dynamic=True, options=opts)
mode = {"m": "eager"}
orig = runner.run_step
from matrixinfer.worker.model_runner import StepOutput
def run_step(reqs, num_decode):
    ids, pos, ctx = runner.prepare(reqs, num_decode)
    if ctx.prompt_cu_seqlens is not None and mode["m"] != "eager":
        with forward_context(ctx):
            return StepOutput(comp(ids, pos))
    return orig(reqs, num_decode)
runner.run_step = run_step
g = torch.Generator().manual_seed(0)
P = lambda: torch.randint(10, 1000, (T,), generator=g).tolist()
params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
def one(tag):
    eng.add_request(tag, {"prompt_token_ids": P()}, params)
    t = time.perf_counter(); eng.step(); return (time.perf_counter() - t) * 1e3
mode["m"] = "comp"; t0 = time.perf_counter(); one("c0"); print("first compiled step s", round(time.perf_counter()-t0, 1))
res = {"eager": [], "comp": []}
for i in range(20):
    for k in res:
        mode["m"] = k; res[k].append(one(f"{k}{i}"))
med = lambda x: round(sorted(x)[len(x)//2], 2)
print(dtype, T, "cpp" if cppw else "py", {k: med(v) for k, v in res.items()})
