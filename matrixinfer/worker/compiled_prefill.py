"""The prefill step of whole new prompts, compiled: where one request's time-to-first-token
goes once decode is compiled.

Eagerly, a 128-token prefill of the bundled model is about 700 PyTorch operators; their
dispatch costs more than the arithmetic (float32, 2 threads: 12.75 ms for the forward, about
5 ms of it GEMMs). A step whose every sequence is a whole prompt with nothing cached before it
(ForwardContext.prompt_cu_seqlens: no decode rows, no prefix hit, a first chunk) attends only
within its own tokens, through one operator opaque to the compiler
(model/attention.py: varlen_causal_attention), so inductor compiles the whole forward with
the token count symbolic. Measured, compiled vs eager engine steps interleaved in one process
(128 tokens, one request): 8.07 vs 12.04 ms float32, 11.71 vs 19.36 ms bfloat16.

The model picks paths from the token count (the dense linears' and the MoE's few-rows
operator, layers/experts.py), so the graph's guards split the token counts into ranges, one
graph each. `warm_up` compiles the ranges up to the step's token budget at start-up; a request
never compiles: steps run under the "eager_on_recompile" stance, so a token count outside
the warmed ranges (a one-token prompt, say) runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.worker.compiled_decode import compile_options, mark_packed_weights_static, own_code

log = logging.getLogger(__name__)

# 0 and 1 are specialised by the compiler, 2 is the MoE's "pairs" range, and at 3 duck sizing
# would tie the token count to _dummy_step's offsets (3 of them)
MIN_WARM_TOKENS = 4


def prefill_step(model: DeepseekForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the graph computes: the final hidden states (the head runs on the sampled rows only)."""
    return model.forward(input_ids, positions)


def warm_sizes(max_tokens: int) -> list[int]:
    """The token counts warm_up runs: MIN_WARM_TOKENS, then each power of two p and 3p/2 up
    to max_tokens, and max_tokens. The thresholds that split the ranges sit at powers of two,
    either side (layers/quantization.py, layers/experts.py, kernels: bfloat16 keeps ranges
    3-32, 33-127, 128-256 and 257 on), so a range between two of them holds p or 3p/2."""
    sizes, p = [MIN_WARM_TOKENS], 4
    while p < max_tokens:
        sizes += [p, 3 * p // 2]
        p *= 2
    return sorted({s for s in sizes + [max_tokens] if s <= max_tokens})


class CompiledPrefill:
    def __init__(self, model: DeepseekForCausalLM, pad_block: int, block_size: int):
        self.model = model
        self.pad_block, self.block_size = pad_block, block_size  # warm-up steps write their latents there
        self.forward = torch.compile(own_code(prefill_step, model), dynamic=True, options=compile_options())
        self.compile_s = 0.0
        self.graphs = 0  # token-count ranges compiled by warm_up
        # past the warm-up: a step no graph's guards take runs eagerly (tests set
        # "fail_on_recompile" to prove the warm-up covered a size)
        self.stance = "eager_on_recompile"
        self.steps = 0  # steps served (the warm-up's not counted)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step's hidden states [tokens, hidden]; ctx.prompt_cu_seqlens is set."""
        self.steps += 1
        with forward_context(ctx), torch.compiler.set_stance(self.stance):
            return self.forward(input_ids, positions)

    def _dummy_step(self, n: int, device: torch.device):
        """A step of n tokens in two prompts (so the sequence count is not specialised either),
        all writing into the pad block."""
        first = n // 2
        cu = torch.tensor([0, first, n], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(first), torch.arange(n - first)]).to(device)
        positions = positions % self.model.config.max_position_embeddings
        slots = self.pad_block * self.block_size + torch.arange(n, device=device) % self.block_size
        ctx = ForwardContext([first, n - first], [first, n - first], slots,
                             torch.full((2, 1), self.pad_block, dtype=torch.long, device=device), 0,
                             torch.tensor([first, n - first], dtype=torch.long, device=device), prompt_cu_seqlens=cu)
        return torch.zeros(n, dtype=torch.long, device=device), positions, ctx

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, device: torch.device, report=None) -> float:
        """Compile the graphs for every token count up to max_tokens (the step's budget): run
        warm_sizes, where a size whose guards already hold costs a forward, not a compile.
        Returns the seconds spent."""
        from torch._dynamo.utils import counters

        t, before = time.perf_counter(), counters["stats"]["unique_graphs"]
        mark_packed_weights_static(self.model)  # before compiling (a no-op where the decode warm-up did it)
        for n in warm_sizes(max_tokens):
            if report is not None:
                report(f"prefill step, {n} of {max_tokens} tokens: compiling (or loading from inductor's cache)")
            ids, pos, ctx = self._dummy_step(n, device)
            with forward_context(ctx):
                self.forward(ids, pos)
        self.graphs = counters["stats"]["unique_graphs"] - before
        self.compile_s = time.perf_counter() - t
        return self.compile_s
