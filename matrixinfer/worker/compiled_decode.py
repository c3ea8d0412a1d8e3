"""The decode step compiled once and replayed: the CPU counterpart of the CUDA graphs vLLM
and SGLang capture for decode batches.

A decode-only step (every sequence adds one token) is the engine's steady state and, at small
batch, almost all fixed cost: a few hundred PyTorch operators of microseconds each. Its
attention reads only tensors (ForwardContext.decode_only) and the MoE picks a sync-free path
from shapes, so inductor compiles the whole forward into a few fused C++ kernels. Shapes are
dynamic (batch size and block-table width are symbolic), so a handful of graphs covers every
batch: size 1 and the batch sizes where the experts change path get their own. Compiling
happens at start-up (`warm_up`), and inductor caches the result on disk, so a restart pays
seconds, not the first compile.
"""

from __future__ import annotations

import time

import torch

from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM

MIN_TABLE_WIDTH = 2  # width 1 would be specialised by the compiler: pad to 2 (masked by the lengths)


class CompiledDecode:
    def __init__(self, model: DeepseekForCausalLM):
        self.model = model
        # cpp_wrapper: the graph's launcher is C++ too (measured: 0.84 vs 1.00 ms a step at batch
        # 1, 1.83 vs 2.27 at 8, bundled model, float32, 2 threads)
        self.forward = torch.compile(model.forward, dynamic=True, options={"cpp_wrapper": True})
        self.compile_s = 0.0
        self.steps = 0  # decode steps served (warm-up included)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        self.steps += 1
        with forward_context(ctx):
            return self.forward(input_ids, positions)

    @torch.inference_mode()
    def warm_up(self, max_batch: int, device: torch.device) -> float:
        """Compile for every batch-size range up to max_batch (powers of two: sizes whose
        guards already hold cost one call, not a compile). The dummy tokens write into block 0,
        which any real sequence overwrites before it reads it. Returns the seconds spent."""
        t = time.perf_counter()
        b = 1
        while True:
            ids = torch.zeros(b, dtype=torch.long, device=device)
            tables = torch.zeros(b, MIN_TABLE_WIDTH, dtype=torch.long, device=device)
            lens = torch.ones(b, dtype=torch.long, device=device)
            ctx = ForwardContext([], [], torch.zeros(b, dtype=torch.long, device=device), tables, b, lens,
                                 decode_only=True)
            self(ids, torch.zeros_like(ids), ctx)  # distinct tensors: aliasing would be guarded on
            if b >= max_batch:
                break
            b = min(2 * b, max_batch)
        self.compile_s = time.perf_counter() - t
        return self.compile_s
