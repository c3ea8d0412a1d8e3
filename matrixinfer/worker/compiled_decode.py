"""The decode step compiled once and replayed: the CPU counterpart of the CUDA graphs vLLM
and SGLang capture for decode batches.

A decode-only step (every sequence adds one token) is the engine's steady state and, at small
batch, almost all fixed cost: a few hundred PyTorch operators of microseconds each. Its
attention reads only tensors (ForwardContext.decode_only) and the MoE picks a sync-free path
from shapes, so inductor compiles the whole forward into a few fused C++ kernels.

Two kinds of graph, measured on the bundled model (float32, 2 threads, forward only):
- small batches (up to 8) are padded to a bucket (1, 2, 4, 8) and run a graph with static
  shapes, only the block-table width symbolic: 0.66 vs 0.81 ms at 1 sequence, 1.59 vs 1.82 at
  8 against one dynamic graph (fewer guards and size arguments per call, specialised kernels).
  Padding rows write their latents into a block no sequence owns (`pad_block`).
- larger batches run one graph with a symbolic batch size, unpadded: there static shapes did
  not measurably win (2.50 vs 2.43 ms at 16, 3.48 vs 3.94 at 32, 8.74 vs 8.39 at 64), and a
  graph per size would multiply the compile time.
Compiling happens at start-up (`warm_up`), and inductor caches the result on disk, so a
restart pays the tracing, not the C++ compiles.
"""

from __future__ import annotations

import time
import types

import torch

from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM

MIN_TABLE_WIDTH = 2  # width 1 would be specialised by the compiler: pad to 2 (masked by the lengths)
STATIC_BATCHES = (1, 2, 4, 8)  # padded batch sizes with a static graph each


def padded_batch(n: int) -> int:
    """The batch size a decode step of n sequences runs at: the next static bucket, or n."""
    return next((b for b in STATIC_BATCHES if b >= n), n)


def _guards_to_keep(entries) -> list[bool]:
    """No guards on module attributes but the layers' cache views: 0.07 ms of the 0.68 a call
    costs at batch 1. Safe because the graphs serve one model instance (_own_forward) whose
    weights load before warm_up and change in place only; a runner that re-binds the cache
    views is still caught."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() or "kv_cache" in e.name for e in entries]


def _own_forward(model: DeepseekForCausalLM):
    """model.forward with a code object of its own. Dynamo keeps compiled graphs on the code
    object, so without this every model of the process would share them, and with module
    guards dropped a graph of one checkpoint could run another's weights."""
    f = type(model).forward
    code = f.__code__.replace()
    return types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__).__get__(model)


class CompiledDecode:
    def __init__(self, model: DeepseekForCausalLM, pad_block: int, block_size: int):
        self.model = model
        self.pad_block, self.block_size = pad_block, block_size  # a cache block no sequence owns: padding rows write there
        # cpp_wrapper: the graph's launcher is C++ too (measured: 0.84 vs 1.00 ms a step at batch
        # 1, 1.83 vs 2.27 at 8, bundled model, float32, 2 threads)
        # a dict per call: torch.compile pops guard_filter_fn out of the one it is given (with one
        # shared dict the second graph kept every guard: 0.33 ms of lookup a step at 32 sequences)
        options = lambda: {"cpp_wrapper": True, "guard_filter_fn": _guards_to_keep}  # noqa: E731
        forward = _own_forward(model)
        self.static = torch.compile(forward, dynamic=False, options=options())
        self.dynamic = torch.compile(forward, dynamic=True, options=options())
        self.compile_s = 0.0
        self.steps = 0  # decode steps served (warm-up included)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [padded_batch(n)]: the runner pads small batches (ModelRunner.prepare)."""
        self.steps += 1
        if input_ids.shape[0] <= STATIC_BATCHES[-1]:
            torch._dynamo.mark_dynamic(ctx.block_tables, 1)  # the one symbolic size of a static graph
            forward = self.static
        else:
            forward = self.dynamic
        with forward_context(ctx):
            return forward(input_ids, positions)

    @torch.inference_mode()
    def warm_up(self, max_batch: int, device: torch.device) -> float:
        """Compile every static bucket up to max_batch, then run every larger size once: the
        dynamic graph's guards split the sizes where the model's shape-chosen paths change (the
        MoE's, layers/experts.py), and a size whose guards already hold costs one forward, not a
        compile, so no request meets a compile later (one did, for 15 s, when the warm-up
        stepped over a range). The dummy rows write into the pad block. Returns the seconds spent."""
        t = time.perf_counter()
        sizes = [b for b in STATIC_BATCHES if b <= padded_batch(max_batch)]
        sizes += range(STATIC_BATCHES[-1] + 1, max_batch + 1)
        for b in sizes:
            ids = torch.zeros(b, dtype=torch.long, device=device)
            tables = torch.full((b, MIN_TABLE_WIDTH), self.pad_block, dtype=torch.long, device=device)
            lens = torch.ones(b, dtype=torch.long, device=device)
            slots = torch.full((b,), self.pad_block * self.block_size, dtype=torch.long, device=device)
            ctx = ForwardContext([], [], slots, tables, b, lens, decode_only=True)
            self(ids, torch.zeros_like(ids), ctx)  # distinct tensors: aliasing would be guarded on
        self.compile_s = time.perf_counter() - t
        return self.compile_s
