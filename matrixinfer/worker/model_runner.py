"""Turns a scheduled step into tensors, runs the model over the paged latent KV cache and
samples on the device. Returns token ids (and logprobs), never logits: that is what crosses
the process boundary when ranks are processes."""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import torch

from matrixinfer.engine.request import Logprob, PromptLogprobs
from matrixinfer.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from matrixinfer.kernels import argmax_rows, load_cpu_ops, pack_small_mm, small_mm_serves
from matrixinfer.model import batch_invariant
from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM
from matrixinfer.model.layers import RMSNorm
from matrixinfer.model.moe import Router
from matrixinfer.worker.compiled_decode import MIN_TABLE_WIDTH, CompiledDecode, padded_batch
from matrixinfer.worker.compiled_prefill import CompiledPrefill
from matrixinfer.worker.sampler import SamplingRow, sample
from matrixinfer.worker.structured_output import GrammarMasks
from matrixinfer.worker.spec_decode import SpecBatch, add_decode_queries, draft_context, verify


def prepare_small_mm(model: DeepseekForCausalLM) -> None:
    """The copies of the weights the few-rows operator reads (kernels.small_mm), where it serves
    (in batch-invariant mode the router's too)."""
    for module in model.modules():
        if hasattr(module, "quant_method"):
            module.quant_method.pack_small_mm(module)
        if isinstance(module, Router) and module.batch_invariant:
            module.weight_small_mm = pack_small_mm(module.weight, pad_outputs=True)
        if isinstance(module, RMSNorm) and module.batch_invariant:
            module.ones_small_mm = pack_small_mm(torch.ones(16, module.weight.shape[0], device=module.weight.device))
    for attn in model.attention_layers():
        attn.prepare_absorbed()


def enable_batch_invariant(model: DeepseekForCausalLM, device: torch.device) -> None:
    """model/batch_invariant.py's mode on `model`, or a ValueError where its operators cannot serve."""
    dtype = model.lm_head.weight.dtype
    if device.type != "cpu" or not load_cpu_ops() or not small_mm_serves(dtype, device) \
            or not small_mm_serves(torch.float32, device):
        raise ValueError(f"batch-invariant mode runs on matrixinfer's CPU operators (kernels.small_mm, "
                         f"paged_mla_decode), which do not serve {dtype} on {device} here")
    batch_invariant.enable(model)


class StepOutput(NamedTuple):
    """The model over one step: final hidden states [tokens, hidden]; where a compiled decode
    step ran, also every row's logits and their argmax, computed inside its graph."""
    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    greedy: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 compile_decode: bool = False, num_spec_tokens: int = 0, compile_prefill: bool = False,
                 batch_invariant: bool = False):
        self.model, self.device, self.block_size = model, device, block_size
        # batch-invariant mode: every step a decode step over tokens (prepare), on one graph
        self.batch_invariant = batch_invariant
        if batch_invariant:
            enable_batch_invariant(model, device)
            compile_prefill = False
        if device.type == "cpu":  # matrixinfer/kernels: built once per machine
            load_cpu_ops()
            prepare_small_mm(model)
        self.num_spec_tokens = num_spec_tokens  # MTP drafts per step (0: no speculative decoding)
        if num_spec_tokens and not len(model.model.mtp):
            raise ValueError("speculative method mtp needs a checkpoint with an MTP module (num_nextn_predict_layers "
                             "> 0 and its weights): this one has none")
        # compiled decode steps pad small batches, and compiled prefill warms up on dummy
        # prompts: those rows write into one extra block past the num_blocks the KV cache
        # manager hands out
        self.compiled_decode = CompiledDecode(model, num_blocks, block_size) if compile_decode else None
        self.compiled_prefill = CompiledPrefill(model, num_blocks, block_size) if compile_prefill else None
        dtype = model.lm_head.weight.dtype  # the model dtype (the router alone stays float32)
        layers = model.attention_layers()
        # One tensor for all layers: [layers, blocks, block_size, kv_lora_rank + rope]
        pad = int(compile_decode or compile_prefill)
        self.kv_cache = torch.zeros(len(layers), num_blocks + pad, block_size, model.config.kv_cache_dim,
                                    dtype=dtype, device=device)
        for i, attn in enumerate(layers):
            attn.kv_cache = self.kv_cache[i]
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' RNGs live across steps
        self.grammars: GrammarMasks | None = None  # structured outputs' masks (set by the worker)
        # multi-step decode ends after the current step when this says so (the engine core's: a
        # message arrived, a request to join the batch, say); set only where one rank runs
        self.interrupt: Callable[[], bool] | None = None

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int, report: Callable[[str], None] | None = None) -> None:
        """Compile the decode and prefill graphs now (the cache exists), not on the first
        request: every decode batch size up to max_num_seqs, every prefill token count up to
        the step's budget. report: told each size as its warm-up starts."""
        if self.compiled_decode is not None:
            self.compiled_decode.warm_up(max_num_seqs, self.device, report)
            if self.batch_invariant and max_num_batched_tokens > max_num_seqs:  # prompts run the decode graph too
                self.compiled_decode.warm_up_size(max_num_batched_tokens, self.device, report)
        if self.compiled_prefill is not None:
            self.compiled_prefill.warm_up(max_num_batched_tokens, self.device, report)

    @staticmethod
    def cache_bytes_per_block(model: DeepseekForCausalLM, block_size: int) -> int:
        dtype = model.lm_head.weight.dtype
        return len(model.attention_layers()) * block_size * model.config.kv_cache_dim * dtype.itemsize

    def prepare(self, reqs: list[ScheduledRequest], num_decode: int):
        """The step's tensors. A decode-only step for the compiled graphs gets a block table at
        least MIN_TABLE_WIDTH wide and, at small batch, padding rows (padded_batch): token 0 at
        position 0 writing into the pad block, which their one-token context reads. A step of
        whole new prompts (no decode rows, each from position 0) gets prompt_cu_seqlens."""
        if self.batch_invariant:
            return self._prepare_tokens(reqs)
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        bs = self.block_size
        for r in reqs:
            n, start = len(r.token_ids), r.start_pos
            input_ids += r.token_ids
            if n == 1:  # a decode row
                positions.append(start)
                slots.append(r.block_table[start // bs] * bs + start % bs)
            else:
                positions += range(start, start + n)
                slots += [r.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            context_lens.append(start + n)
        decode_only = num_decode == len(reqs) and len(input_ids) == len(reqs)
        tables = [r.block_table for r in reqs]
        ctx = self._context(input_ids, positions, slots, query_lens, context_lens, tables, num_decode, decode_only)
        if num_decode == 0 and all(r.start_pos == 0 for r in reqs):
            ctx.prompt_cu_seqlens = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.long,
                                                 device=self.device)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), ctx)

    def _prepare_tokens(self, reqs: list[ScheduledRequest]):
        """prepare() in batch-invariant mode: every token a decode row (its sequence's block
        table, the context up to itself), whatever step it is in. The chunk's latents are all
        written before any row attends, so each row sees exactly its prefix."""
        input_ids, positions, slots, tables = [], [], [], []
        bs = self.block_size
        for r in reqs:
            input_ids += r.token_ids
            n, start = len(r.token_ids), r.start_pos
            positions += range(start, start + n)
            slots += [r.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
            tables += [r.block_table] * n
        lens = [p + 1 for p in positions]
        ctx = self._context(input_ids, positions, slots, [1] * len(lens), lens, tables, len(lens), True)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), ctx)

    def _context(self, input_ids: list[int], positions: list[int], slots: list[int], query_lens: list[int],
                 context_lens: list[int], tables: list[list[int]], num_decode: int,
                 decode_only: bool) -> ForwardContext:
        """The step's ForwardContext from its host lists (padded in place, see prepare): block
        tables padded to one width; a decode-only step for the compiled graphs at least
        MIN_TABLE_WIDTH wide, with padding rows up to its bucket."""
        bs, rows = self.block_size, len(tables)
        width = max(len(t) for t in tables)
        if decode_only and self.compiled_decode is not None:
            width = max(width, MIN_TABLE_WIDTH)
            pad, pad_block = padded_batch(rows) - rows, self.compiled_decode.pad_block
            tables = tables + [[pad_block] * width] * pad
            input_ids += [0] * pad
            positions += [0] * pad
            slots += [pad_block * bs] * pad
            context_lens += [1] * pad
        tables = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        return ForwardContext(
            query_lens=query_lens, context_lens=context_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            num_decode_seqs=num_decode,
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.long, device=dev),
            decode_only=decode_only,
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, skip: set[str] = frozenset(),
                      driver: bool = True) -> ModelRunnerOutput | None:
        """One forward step over sched's requests except those in `skip` (their KV failed to
        load). Only the driver rank samples; the others return None."""
        for rid in sched.finished_request_ids:
            self.generators.pop(rid, None)
        if self.grammars is not None:
            self.grammars.finish(sched.finished_request_ids)
        reqs = [r for r in sched.requests if r.request_id not in skip]
        if not reqs:
            return ModelRunnerOutput([], [], failed_kv_load_request_ids=set(skip)) if driver else None
        num_decode = sum(1 for r in reqs[: sched.num_decode] if len(r.token_ids) == 1 + r.num_draft)
        if self.num_spec_tokens:
            return self._execute_spec(reqs, num_decode, skip, driver)
        if sched.num_steps > 1:
            return self._execute_steps(reqs, sched.num_steps, skip, driver)
        sampling = [(i, r) for i, r in enumerate(reqs) if r.sample]
        step = self.run_step(reqs, num_decode)
        if not driver:
            return None
        hidden_all, logits = step.hidden, step.logits
        prompt_logprobs = self.prompt_logprobs(reqs, hidden_all)
        if not sampling:
            return ModelRunnerOutput([], [], failed_kv_load_request_ids=set(skip), prompt_logprobs=prompt_logprobs)
        n = len(reqs)
        if len(sampling) == n == hidden_all.shape[0]:  # one row per request, all sampled (decode)
            hidden = hidden_all
            logits = logits[:n] if logits is not None else None
        else:
            hidden, logits = hidden_all[self._last_rows(reqs)[[i for i, _ in sampling]]], None
        if logits is not None and step.greedy is not None and all(r.params.takes_argmax(len(r.output_token_ids or ()))
                                                                  for r in reqs):
            tokens, logprobs = step.greedy.tolist()[:n], None  # the sampler would pick the graph's argmax
        else:
            out = self._sample(self.model.compute_logits(hidden) if logits is None else logits,
                               [r for _, r in sampling])
            tokens = out.token_ids.tolist()
            logprobs = self._logprobs(out, tokens, sampling)
        return ModelRunnerOutput([r.request_id for _, r in sampling], tokens, logprobs,
                                 set(skip), hidden.cpu() if sched.return_hidden_states else None, prompt_logprobs)

    def _execute_steps(self, reqs: list[ScheduledRequest], k: int, skip, driver: bool):
        """k decode steps of the compiled graph (SchedulerOutput.num_steps), each step's greedy
        tokens the next one's inputs; the scheduler gave every row slots for k tokens and
        schedules this only where the raw argmax is the sampler's pick. One transfer to the host
        at the end, the k tokens per request returned as spec decode returns accepted ones (or
        fewer, where `interrupt` ended the run early)."""
        if self.compiled_decode is None or len(reqs) != sum(len(r.token_ids) for r in reqs):
            raise ValueError("multi-step decode needs decode-only steps on the compiled decode graph")
        ids, pos, ctx = self.prepare(reqs, len(reqs))
        picks = [self.compiled_decode(ids, pos, ctx)[2]]
        for pos, slots, lens in self._later_steps(reqs, k, ids.shape[0]):
            if self.interrupt is not None and self.interrupt():
                break  # fewer tokens than k: the scheduler takes what came (the lookahead slots stay allocated)
            picks.append(self.compiled_decode.run((picks[-1], pos, slots, ctx.block_tables, lens))[2])
        if not driver:
            return None
        n = len(reqs)
        new = torch.stack(picks, dim=1)[:n].tolist()
        return ModelRunnerOutput([r.request_id for r in reqs], [t[0] for t in new], None, set(skip),
                                 new_token_ids=new)

    def _later_steps(self, reqs: list[ScheduledRequest], k: int, padded: int) -> list[tuple[torch.Tensor, ...]]:
        """(positions, slots, context lengths) of decode steps 1 ... k-1, padding rows as
        prepare makes them: views of one tensor made by two unbinds (an indexing op per view
        cost 8 us, 27 us a step at batch 1), each 64-byte aligned like a tensor of its own (the
        replayed graph skips inductor's alignment checks)."""
        bs, pad_block = self.block_size, self.compiled_decode.pad_block
        width = -(-padded // 8) * 8
        host = torch.zeros(3, k - 1, width, dtype=torch.long)
        host[1].fill_(pad_block * bs)
        host[2].fill_(1)
        pos, slots, lens = ([[0] * len(reqs) for _ in range(k - 1)] for _ in range(3))
        for i, r in enumerate(reqs):
            for step in range(1, k):
                p = r.start_pos + step
                pos[step - 1][i], slots[step - 1][i], lens[step - 1][i] = p, r.block_table[p // bs] * bs + p % bs, p + 1
        host[:, :, :len(reqs)] = torch.tensor([pos, slots, lens])
        return [step.unbind() for step in host.to(self.device)[:, :, :padded].transpose(0, 1).unbind()]

    def _sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]):
        rows = [SamplingRow(r.params, r.prompt_token_ids or [], r.output_token_ids or [], self._generator(r),
                            r.eos_token_ids) for r in reqs]
        return sample(logits, rows, self.grammars.constrain(reqs) if self.grammars is not None else None)

    @staticmethod
    def _logprobs(out, tokens: list[int], sampling) -> list[Logprob | None] | None:
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
        return logprobs

    def _execute_spec(self, reqs: list[ScheduledRequest], num_decode: int, skip, driver: bool):
        """A step with MTP speculation: verify the drafts, accept on the device, draft the next
        tokens with the MTP module, then one transfer to the host (spec_decode.py). Every rank
        runs all of it: the MTP layer is tensor-parallel too, so every rank needs its inputs."""
        k, bs = self.num_spec_tokens, self.block_size
        b = SpecBatch.build(reqs, self.model.config.vocab_size, self.device, self._generator)
        ids, pos, ctx = self.prepare(reqs, num_decode)
        if not self.batch_invariant:  # there every verify query is a row of its own already
            add_decode_queries(ctx, reqs, self.device)
        plain = [(i, r) for i, r in enumerate(reqs) if r.sample and not r.spec]
        with forward_context(ctx):
            hidden = self.model(ids, pos)
            mtp_ids = b.shifted_ids.clone()
            if len(b.rows):
                tokens, accepted = verify(self.model.compute_logits(hidden[b.rows]), b)
                mtp_ids[b.rows] = tokens
            plain_out = None
            if plain:
                plain_out = self._sample(self.model.compute_logits(hidden[b.plain_rows]), [r for _, r in plain])
                mtp_ids[b.plain_rows] = plain_out.token_ids
            # the MTP module: its KV at every position of the step; attention, MLP and head only
            # at each speculating request's last accepted row, where it drafts from
            at = b.first_token + accepted if len(b.rows) else None
            p = pos[at] if at is not None else None
            h = self.model.mtp_draft(hidden, mtp_ids, pos + 1, at,
                                     draft_context(ctx, b, p, reqs, 0, bs, self.batch_invariant) if at is not None
                                     else None)
        drafts = []
        if at is not None:
            for depth in range(k):
                drafts.append(argmax_rows(self.model.compute_logits(h).float()))
                if depth + 1 < k:  # the MTP layer again, one position further, on its own output
                    with forward_context(draft_context(ctx, b, p, reqs, depth + 1, bs, self.batch_invariant)):
                        h = self.model.mtp_forward(h, drafts[-1], p + depth + 2,
                                                   depth=min(depth + 1, len(self.model.model.mtp) - 1))
        if not driver:
            return None
        # the step's one device-to-host transfer
        parts = [tokens, accepted, *drafts] if len(b.rows) else []
        parts += [plain_out.token_ids] if plain else []
        host = torch.cat(parts).tolist() if parts else []
        r_, s_ = len(b.rows), len(b.num_rows)
        row_tokens, n_acc = host[:r_], host[r_:r_ + s_]
        draft_lists = [host[r_ + s_ + d * s_: r_ + s_ + (d + 1) * s_] for d in range(k)] if s_ else []
        plain_tokens = host[r_ + s_ + k * s_:] if s_ else host
        by_index = {}
        for s, i in enumerate(b.host_req_index):
            start = b.row_start[s]
            by_index[i] = (row_tokens[start:start + n_acc[s] + 1], [dl[s] for dl in draft_lists], None)
        plain_lps = self._logprobs(plain_out, plain_tokens, plain) if plain else None
        for j, (i, _) in enumerate(plain):
            by_index[i] = ([plain_tokens[j]], [], plain_lps[j] if plain_lps else None)
        order = sorted(by_index)
        new = [by_index[i][0] for i in order]
        lps = [by_index[i][2] for i in order]
        return ModelRunnerOutput([reqs[i].request_id for i in order], [t[0] for t in new],
                                 lps if any(lp is not None for lp in lps) else None, set(skip),
                                 prompt_logprobs=self.prompt_logprobs(reqs, hidden), new_token_ids=new,
                                 draft_token_ids=[by_index[i][1] for i in order])

    @torch.inference_mode()
    def run_step(self, reqs: list[ScheduledRequest], num_decode: int) -> StepOutput:
        """The model over one step's tokens. A compiled decode step's logits and greedy tokens
        keep its padding rows (the caller takes the first len(reqs)). Runners of other parallel
        layouts override this."""
        ids, pos, ctx = self.prepare(reqs, num_decode)
        if ctx.decode_only and self.compiled_decode is not None:
            hidden, logits, greedy = self.compiled_decode(ids, pos, ctx)
            return StepOutput(hidden[: ctx.num_decode_seqs], logits, greedy)  # a row per token, padding dropped
        if ctx.prompt_cu_seqlens is not None and self.compiled_prefill is not None:
            return StepOutput(self.compiled_prefill(ids, pos, ctx))
        with forward_context(ctx):
            return StepOutput(self.model(ids, pos))

    def run(self, reqs: list[ScheduledRequest], num_decode: int) -> torch.Tensor:
        """run_step's hidden states."""
        return self.run_step(reqs, num_decode).hidden

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
