"""Turns a scheduled step into tensors, runs the model over the paged latent KV cache and
samples on the device. Returns token ids (and logprobs), never logits: that is what crosses
the process boundary when ranks are processes."""

from __future__ import annotations

import torch

from matrixinfer.engine.request import Logprob, PromptLogprobs
from matrixinfer.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.worker.compiled_decode import MIN_TABLE_WIDTH, CompiledDecode
from matrixinfer.worker.sampler import SamplingRow, sample


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 compiled_decode: CompiledDecode | None = None):
        self.model, self.device, self.block_size = model, device, block_size
        self.compiled_decode = compiled_decode  # None: every step eager
        dtype = model.lm_head.weight.dtype  # the model dtype (the router alone stays float32)
        layers = model.attention_layers()
        # One tensor for all layers: [layers, blocks, block_size, kv_lora_rank + rope]
        self.kv_cache = torch.zeros(len(layers), num_blocks, block_size, model.config.kv_cache_dim,
                                    dtype=dtype, device=device)
        for i, attn in enumerate(layers):
            attn.kv_cache = self.kv_cache[i]
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' RNGs live across steps

    @staticmethod
    def cache_bytes_per_block(model: DeepseekForCausalLM, block_size: int) -> int:
        dtype = model.lm_head.weight.dtype
        return len(model.attention_layers()) * block_size * model.config.kv_cache_dim * dtype.itemsize

    def prepare(self, reqs: list[ScheduledRequest], num_decode: int):
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        bs = self.block_size
        for r in reqs:
            n = len(r.token_ids)
            input_ids += r.token_ids
            positions += range(r.start_pos, r.start_pos + n)
            slots += [r.block_table[p // bs] * bs + p % bs for p in range(r.start_pos, r.start_pos + n)]
            query_lens.append(n)
            context_lens.append(r.start_pos + n)
        decode_only = num_decode == len(reqs) and len(input_ids) == len(reqs)
        max_blocks = max(len(r.block_table) for r in reqs)
        if decode_only:
            max_blocks = max(max_blocks, MIN_TABLE_WIDTH)
        tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in reqs]
        dev = self.device
        ctx = ForwardContext(
            query_lens=query_lens, context_lens=context_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            num_decode_seqs=num_decode,
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.long, device=dev),
            decode_only=decode_only,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), ctx)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, skip: set[str] = frozenset(),
                      driver: bool = True) -> ModelRunnerOutput | None:
        """One forward step over sched's requests except those in `skip` (their KV failed to
        load). Only the driver rank samples; the others return None."""
        for rid in sched.finished_request_ids:
            self.generators.pop(rid, None)
        reqs = [r for r in sched.requests if r.request_id not in skip]
        if not reqs:
            return ModelRunnerOutput([], [], failed_kv_load_request_ids=set(skip)) if driver else None
        num_decode = sum(1 for r in reqs[: sched.num_decode] if len(r.token_ids) == 1)
        sampling = [(i, r) for i, r in enumerate(reqs) if r.sample]
        hidden_all = self.run(reqs, num_decode)
        if not driver:
            return None
        prompt_logprobs = self.prompt_logprobs(reqs, hidden_all)
        if not sampling:
            return ModelRunnerOutput([], [], failed_kv_load_request_ids=set(skip), prompt_logprobs=prompt_logprobs)
        hidden = hidden_all[self._last_rows(reqs)[[i for i, _ in sampling]]]
        logits = self.model.compute_logits(hidden)
        rows = [SamplingRow(r.params, r.prompt_token_ids or [], r.output_token_ids or [], self._generator(r),
                            r.eos_token_ids) for _, r in sampling]
        out = sample(logits, rows)
        tokens = out.token_ids.tolist()
        logprobs = None
        if out.logprobs is not None:
            lps = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_vals = out.top_logprobs.tolist() if out.top_ids is not None else None
            logprobs = []
            for j, (_, r) in enumerate(sampling):
                k = r.params.logprobs
                if k is None:
                    logprobs.append(None)
                    continue
                top = dict(zip(top_ids[j][:k], top_vals[j][:k])) if k else {}
                logprobs.append(Logprob(tokens[j], lps[j], top))
        return ModelRunnerOutput([r.request_id for _, r in sampling], tokens, logprobs, set(skip),
                                 hidden.cpu() if sched.return_hidden_states else None, prompt_logprobs)

    @torch.inference_mode()
    def run(self, reqs: list[ScheduledRequest], num_decode: int) -> torch.Tensor:
        """The model over one step's tokens: final hidden states [tokens, hidden]."""
        ids, pos, ctx = self.prepare(reqs, num_decode)
        if ctx.decode_only and self.compiled_decode is not None:
            return self.compiled_decode(ids, pos, ctx)
        with forward_context(ctx):
            return self.model(ids, pos)

    @torch.inference_mode()
    def forward(self, reqs: list[ScheduledRequest], num_decode: int, logit_rows: list[int]) -> torch.Tensor:
        """The model over one step's tokens; logits at the last token of reqs[i] for i in logit_rows."""
        hidden = self.run(reqs, num_decode)
        return self.model.compute_logits(hidden[self._last_rows(reqs)[logit_rows]])

    def _last_rows(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        return torch.tensor([len(r.token_ids) for r in reqs], device=self.device).cumsum(0) - 1

    def prompt_logprobs(self, reqs: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        """For chunks that ask: log-softmax (float32) of the logits at each position that
        predicts a prompt token, that token's logprob and rank, and the top N."""
        out, start = {}, 0
        for r in reqs:
            targets = r.next_prompt_token_ids
            if r.prompt_logprobs is not None and targets:
                lp = torch.log_softmax(self.model.compute_logits(hidden[start:start + len(targets)]).float(), dim=-1)
                tgt = torch.tensor(targets, device=lp.device)
                tok_lp = lp.gather(1, tgt[:, None])
                ranks = (lp > tok_lp).sum(-1) + 1
                top_vals, top_ids = lp.topk(r.prompt_logprobs, dim=-1)
                out[r.request_id] = PromptLogprobs(tok_lp[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                                   top_vals.tolist())
            start += len(r.token_ids)
        return out

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        if r.params.seed is None:
            return None
        g = self.generators.get(r.request_id)
        if g is None:
            g = self.generators[r.request_id] = torch.Generator().manual_seed(r.params.seed)
        return g
