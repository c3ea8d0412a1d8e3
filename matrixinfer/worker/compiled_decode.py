"""The decode step compiled once and replayed: the CPU counterpart of the CUDA graphs vLLM
and SGLang capture for decode batches.

A decode-only step (every sequence adds one token) is the engine's steady state and, at small
batch, almost all fixed cost: a few hundred PyTorch operators of microseconds each. Its
attention reads only tensors (ForwardContext.decode_only) and the MoE picks a sync-free path
from shapes, so inductor compiles the whole forward, and the head after it (the logits of
every row), into a few fused C++ kernels.

Two kinds of graph, measured on the bundled model (float32, 2 threads, forward only):
- small batches (up to 8) are padded to a bucket (1, 2, 4, 8) and run a graph with static
  shapes, only the block-table width symbolic: 0.66 vs 0.81 ms at 1 sequence, 1.59 vs 1.82 at
  8 against one dynamic graph (fewer guards and size arguments per call, specialised kernels).
  Padding rows write their latents into a block no sequence owns (`pad_block`).
- larger batches run one graph with a symbolic batch size, unpadded: there static shapes did
  not measurably win (2.50 vs 2.43 ms at 16, 3.48 vs 3.94 at 32, 8.74 vs 8.39 at 64), and a
  graph per size would multiply the compile time.
Each batch size's graph is then replayed past torch.compile's per-call machinery (`Replay`),
as vLLM calls its compiled code past Dynamo's guards. Compiling happens at start-up (`warm_up`), and
inductor caches the result on disk, so a restart pays the tracing, not the C++ compiles.
"""

from __future__ import annotations

import logging
import time
import types

import torch

from matrixinfer.kernels import c_shims
from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM

log = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 2  # width 1 would be specialised by the compiler: pad to 2 (masked by the lengths)
STATIC_BATCHES = (1, 2, 4, 8)  # padded batch sizes with a static graph each


def padded_batch(n: int) -> int:
    """The batch size a decode step of n sequences runs at: the next static bucket, or n."""
    return next((b for b in STATIC_BATCHES if b >= n), n)


def _guards_to_keep(entries) -> list[bool]:
    """No guards on module attributes but the layers' cache views: 0.07 ms of the 0.68 a call
    costs at batch 1. Safe because the graphs serve one model instance (own_code) whose
    weights load before warm_up and change in place only; a runner that re-binds the cache
    views is still caught."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() or "kv_cache" in e.name for e in entries]


def decode_step(model: DeepseekForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor):
    """What a graph computes: the final hidden states, the logits of every row and their
    argmax (the head and the greedy pick inside the graph: a greedy row needs no sampler)."""
    hidden = model.forward(input_ids, positions)
    logits = model.compute_logits(hidden)
    return hidden, logits, logits.argmax(dim=-1)


def own_code(step, model: DeepseekForCausalLM):
    """step (decode_step, compiled_prefill.prefill_step) bound to model, with a code object of
    its own. Dynamo keeps compiled graphs on the code object, so without this every model of
    the process would share them, and with module guards dropped a graph of one checkpoint
    could run another's weights."""
    code = step.__code__.replace()
    return types.FunctionType(code, step.__globals__, step.__name__).__get__(model)


def compile_options() -> dict:
    """inductor's options for the engine's compiled steps, a new dict per torch.compile call:
    it pops guard_filter_fn out of the one it is given (with one shared dict the second graph
    kept every guard: 0.33 ms of lookup a step at 32 sequences).
    - cpp_wrapper: the graph's launcher is C++ too (measured: 0.84 vs 1.00 ms a decode step at
      batch 1, 1.83 vs 2.27 at 8, bundled model, float32, 2 threads).
    - no size asserts: the C++ wrapper builds a stringstream for each of the ~120 it checks,
      6 % of a batch-1 step (perf); the shapes are the graph's own and the custom operators'
      fakes are tested.
    - the operators (matrixinfer/kernels) are called through their C shims, not the dispatcher."""
    return {"cpp_wrapper": True, "size_asserts": False, "guard_filter_fn": _guards_to_keep,
            "aot_inductor.custom_ops_to_c_shims": c_shims()}


def decode_context(inputs: tuple[torch.Tensor, ...]) -> ForwardContext:
    """The ForwardContext of a decode-only step given as its five tensors (ids, positions,
    slots, tables, lens)."""
    ids, _, slots, tables, lens = inputs
    return ForwardContext([], [], slots, tables, ids.shape[0], lens, decode_only=True)


def _same_constant(a, a2) -> bool:
    """Two recorded arguments that are one constant: a size of the graph's (an int), or a
    float of the model's (routed_scaling_factor) that a dynamic graph takes per call as a new
    0-d tensor."""
    if isinstance(a, torch.Tensor):
        return isinstance(a2, torch.Tensor) and a.dim() == a2.dim() == 0 and a.dtype == a2.dtype and torch.equal(a, a2)
    return type(a) is type(a2) is int and a == a2


class NotReplayable(Exception):
    """A compiled decode graph that Replay cannot vouch for; the message says which check failed."""


def _describe(a) -> str:
    if isinstance(a, torch.Tensor):
        return f"tensor {tuple(a.shape)} {a.dtype}"
    return f"{type(a).__name__} {a!r}"


class Replay:
    """One graph called directly: inductor's compiled callable with its argument list recorded
    once (weights, packed copies, cache views, sizes) and the step's five tensors and table
    width put in their places. That skips Dynamo's frame hook, guard check and argument
    gathering and AOTAutograd's runtime wrappers: measured 0.36 -> 0.26 ms a call at batch 1
    (bundled model, bfloat16). A replay serves one batch size: the dynamic graph's guards pick
    among its graphs by batch size, and recording every size at warm-up settles that choice
    once. What the guards checked, the runner guarantees: contiguous int64 inputs of the
    recorded shapes under inference mode, weights changed in place only; the cache views are
    checked on every call (a runner that re-binds them drops the replays).

    Recording rests on inductor's CompiledFxGraph (what torch.compile runs last) and two
    steps of one batch size at different table widths; `record` raises NotReplayable, and the
    size keeps the torch.compile path, where it cannot vouch for the recording: not one graph
    call a step, the two steps in different graphs, an argument other than the step's tensors
    and the width that differs between them, or a replay whose outputs differ from the
    compiled path's. The exception says which, so a warm-up log names the check that failed."""

    def __init__(self, fn, args: list, places: list[tuple[int, int]], width_places: list[int], layers: list):
        self.fn, self.args, self.places, self.width_places = fn, args, places, width_places
        self.bound = [(attn, attn.kv_cache) for attn in layers]  # each attention layer and its cache view
        self.widths: dict[int, torch.Tensor] = {}  # table width -> the 0-d tensor the callable takes for it

    @staticmethod
    def _spy(compiled, inputs: tuple[torch.Tensor, ...]):
        """compiled(*inputs), and the (callable, arguments) of each inductor graph it ran."""
        from torch._inductor.output_code import CompiledFxGraph

        calls = []
        call = CompiledFxGraph.__call__

        def spy(graph, args):
            calls.append((graph.current_callable, list(args)))
            return call(graph, args)

        CompiledFxGraph.__call__ = spy
        try:
            return compiled(*inputs), calls
        finally:
            CompiledFxGraph.__call__ = call

    @classmethod
    def record(cls, compiled, model: DeepseekForCausalLM, steps: list[tuple[torch.Tensor, ...]]):
        """Run compiled (the torch.compile'd step) on two steps (ids, positions, slots, tables,
        lens) of one batch size and different table widths, recording the graph calls; then
        replay the second and compare."""
        runs = [cls._spy(compiled, inputs) for inputs in steps]
        counts = [len(calls) for _, calls in runs]
        if counts != [1, 1]:
            raise NotReplayable(f"inductor graph calls per step: {counts}, not one")
        (fn, args), (fn2, args2) = runs[0][1][0], runs[1][1][0]
        if fn2 is not fn or len(args2) != len(args):
            raise NotReplayable(f"the two table widths ran different graphs ({len(args)} and {len(args2)} arguments)")
        where = [{id(t): i for i, t in enumerate(inputs)} for inputs in steps]
        widths = [inputs[3].shape[1] for inputs in steps]
        places, width_places = [], []
        for j, (a, a2) in enumerate(zip(args, args2)):
            if isinstance(a, torch.Tensor) and id(a) in where[0]:
                if where[1].get(id(a2)) != where[0][id(a)]:
                    raise NotReplayable(f"argument {j} is step input {where[0][id(a)]} in one step only")
                places.append((j, where[0][id(a)]))
            elif not isinstance(a, torch.Tensor) and [a, a2] == widths:
                width_places.append(j)
            elif a is not a2 and not _same_constant(a, a2):
                raise NotReplayable(f"argument {j} differs between the steps and is neither a step input nor "
                                    f"the table width: {_describe(a)} vs {_describe(a2)}")
        if len({i for _, i in places}) != len(places):
            raise NotReplayable("a step input fills two argument places")
        replay = cls(fn, args2, places, width_places, model.attention_layers())
        got, want = replay(*steps[1]), runs[1][0]
        if len(got) != len(want) or not all(torch.equal(g, w) for g, w in zip(got, want)):
            raise NotReplayable("the replay's outputs differ from the compiled path's")
        return replay

    def valid(self) -> bool:
        return all(attn.kv_cache is view for attn, view in self.bound)

    def __call__(self, *inputs: torch.Tensor):
        args = self.args.copy()  # the callable empties the list it is given
        for j, i in self.places:
            args[j] = inputs[i]
        if self.width_places:  # the callable would wrap an int in a new tensor each call
            w = inputs[3].shape[1]
            width = self.widths.get(w)
            if width is None:
                width = self.widths[w] = torch.tensor(w)
            for j in self.width_places:
                args[j] = width
        return self.fn(args)


def mark_packed_weights_static(model: torch.nn.Module) -> None:
    """Mark the modules' plain tensor attributes (the few-rows operator's packed weights, the
    absorbed MLA weights, the cache views: not parameters, so dynamic=True makes their sizes symbolic) static.
    Symbolic, duck sizing tied them to inputs of equal size: a dummy step's 3 prompt offsets to
    a 3-row weight, and every later step of another prompt count recompiled. Every compiled
    step's warm-up calls it before it compiles (idempotent): a marking added after a graph was
    compiled fails that graph's guards, and the first step of a size the replays do not serve
    recompiled (20.5 s, served, at a decode batch of 9, when only the prefill warm-up marked).
    The weights are packed by the time the engine warms up."""
    for module in model.modules():
        owned = set(module._parameters) | set(module._buffers)
        for name, value in vars(module).items():
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and name not in owned:
                    for u in (t, t._base) if t._base is not None else (t,):  # a cache view's base is an input too
                        torch._dynamo.mark_static(u)


class CompiledDecode:
    def __init__(self, model: DeepseekForCausalLM, pad_block: int, block_size: int):
        self.model = model
        self.pad_block, self.block_size = pad_block, block_size  # a cache block no sequence owns: padding rows write there
        step = own_code(decode_step, model)
        self.static = torch.compile(step, dynamic=False, options=compile_options())
        self.dynamic = torch.compile(step, dynamic=True, options=compile_options())
        self.replays: dict[int, Replay] = {}  # batch size (padded) -> its graph, replayed directly
        self.compile_s = 0.0
        self.steps = 0  # decode steps served (warm-up included)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """input_ids [padded_batch(n)]: the runner pads small batches (ModelRunner.prepare).
        Returns (hidden states, logits, greedy tokens), one row per input."""
        return self.run((input_ids, positions, ctx.slot_mapping, ctx.block_tables, ctx.context_lens_tensor), ctx)

    def run(self, inputs: tuple[torch.Tensor, ...], ctx: ForwardContext | None = None):
        """The step given as its five tensors (ids, positions, slots, tables, lens); ctx, when
        the caller has it, spares building one on the compiled path."""
        self.steps += 1
        replay = self.replays.get(inputs[0].shape[0])
        if replay is not None:
            if replay.valid():
                return replay(*inputs)
            self.replays.clear()  # the cache views were re-bound: the compiled path recompiles
        return self._compiled(inputs, ctx)

    def _compiled(self, inputs: tuple[torch.Tensor, ...], ctx: ForwardContext | None = None):
        """The step through torch.compile; ctx None: a warm-up step's, built from inputs."""
        ids, pos, _, tables, _ = inputs
        if ids.shape[0] <= STATIC_BATCHES[-1]:
            torch._dynamo.mark_dynamic(tables, 1)  # the one symbolic size of a static graph
            forward = self.static
        else:
            forward = self.dynamic
        with forward_context(ctx or decode_context(inputs)):
            return forward(ids, pos)

    def _dummy_step(self, b: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The five tensors of a step of b padding rows (they write into the pad block),
        distinct tensors: aliasing would be guarded on."""
        ids = torch.zeros(b, dtype=torch.long, device=device)
        tables = torch.full((b, width), self.pad_block, dtype=torch.long, device=device)
        lens = torch.ones(b, dtype=torch.long, device=device)
        slots = torch.full((b,), self.pad_block * self.block_size, dtype=torch.long, device=device)
        return ids, torch.zeros_like(ids), slots, tables, lens

    @torch.inference_mode()
    def warm_up(self, max_batch: int, device: torch.device, report=None) -> float:
        """Compile every static bucket up to max_batch, then run every larger size: the
        dynamic graph's guards split the sizes where the model's shape-chosen paths change (the
        MoE's, layers/experts.py), and a size whose guards already hold costs a forward, not a
        compile, so no request meets a compile later (one did, for 15 s, when the warm-up
        stepped over a range). Each size's graph is then recorded for replay. Returns the
        seconds spent."""
        t = time.perf_counter()
        mark_packed_weights_static(self.model)
        sizes = [b for b in STATIC_BATCHES if b <= padded_batch(max_batch)]
        for b in sizes + list(range(STATIC_BATCHES[-1] + 1, max_batch + 1)):
            if report is not None:
                report(f"decode step, batch {b} of {max_batch}: compiling (or loading from inductor's cache)")
            inputs = self._dummy_step(b, MIN_TABLE_WIDTH, device)
            self(*inputs[:2], decode_context(inputs))
            steps = [self._dummy_step(b, width, device) for width in (MIN_TABLE_WIDTH + 1, MIN_TABLE_WIDTH + 2)]
            try:
                self.replays[b] = Replay.record(lambda *inputs: self._compiled(inputs), self.model, steps)
            except NotReplayable as why:
                log.warning("decode step of %d: the compiled graph could not be recorded for replay (%s); "
                            "it runs through torch.compile", b, why)
        self.compile_s = time.perf_counter() - t
        return self.compile_s

    @torch.inference_mode()
    def warm_up_size(self, b: int, device: torch.device, report=None) -> None:
        """One step of b rows through torch.compile (no replay): in batch-invariant mode a
        prompt's tokens are rows of this graph, up to the step's token budget, and the dynamic
        graph is compiled for them now rather than at the first long prompt."""
        if report is not None:
            report(f"decode step over {b} tokens (batch-invariant prompts): compiling")
        inputs = self._dummy_step(b, MIN_TABLE_WIDTH, device)
        self(*inputs[:2], decode_context(inputs))
