"""The engine loop of one serving instance: add requests, step (schedule -> run -> sample ->
check stops), collect outputs. Everything that owns the device lives in ModelRunner."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from matrixinfer.config import CacheConfig, SchedulerConfig
from matrixinfer.engine.block_manager import BlockManager
from matrixinfer.engine.model_runner import ModelRunner
from matrixinfer.engine.outputs import CompletionOutput, RequestOutput
from matrixinfer.engine.sampler import SamplingRow, sample
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.engine.scheduler import Scheduler
from matrixinfer.engine.sequence import Logprob, Sequence, SequenceStatus
from matrixinfer.engine.tokenizer import Tokenizer
from matrixinfer.model.loader import load_model


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model: str | Path, dtype: str = "auto", device: str = "cpu",
                 cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 kv_cache_memory_gb: float = 1.0, seed: int = 0):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = load_model(model, dtype=dtype, device=self.device)
        self.config = self.model.config
        self.tokenizer = Tokenizer.maybe_load(model)
        self.cache_config = cache = cache or CacheConfig()
        sched = scheduler or SchedulerConfig()
        self.max_model_len = min(sched.max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        dtype_ = self.model.lm_head.weight.dtype
        num_blocks = cache.num_blocks
        if num_blocks is None:
            per_block = ModelRunner.cache_bytes_per_block(self.model, cache.block_size, dtype_)
            wanted = sched.max_num_seqs * -(-self.max_model_len // cache.block_size)
            num_blocks = max(1, min(wanted, int(kv_cache_memory_gb * 2**30) // per_block))
        if num_blocks * cache.block_size < self.max_model_len:
            raise ValueError(f"KV cache of {num_blocks} blocks x {cache.block_size} tokens cannot hold one "
                             f"sequence of max_model_len={self.max_model_len}")
        self.block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks, cache.block_size, self.device)
        eos = set(self.config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.requests: dict[str, Request] = {}
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "preemptions": 0}

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    namespace: str = "", arrival_time: float | None = None) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             f"tokens and at least one must be left for the output")
        if params.stop_list and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model directory has none")
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, i, ids, params, namespace, now) for i in range(params.n)]
        req = Request(request_id, text, ids, params, seqs, now)
        self.requests[request_id] = req
        for s in seqs:
            self.scheduler.add(s)
        return req

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req else []:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        samples = [s.num_computed_tokens + n == len(s) for s, n in zip(batch.seqs, batch.num_tokens)]
        logits = self.runner.run(batch.seqs, batch.num_tokens, samples)
        self.stats["steps"] += 1
        for s, n in zip(batch.seqs, batch.num_tokens):
            self.stats["decode_tokens" if n == 1 and s.output_token_ids else "prefill_tokens"] += n
            s.num_computed_tokens += n
            self.block_manager.commit_full_blocks(s)
        sampled = [s for s, m in zip(batch.seqs, samples) if m]
        touched: dict[str, Request] = {}
        if sampled:
            eos = tuple(self.eos_token_ids)
            out = sample(logits, [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, eos)
                                  for s in sampled])
            tokens = out.token_ids.tolist()
            lps = None if out.logprobs is None else out.logprobs.tolist()
            tops = None if out.top_ids is None else (out.top_ids.tolist(), out.top_logprobs.tolist())
            now = time.monotonic()
            for i, (seq, tok) in enumerate(zip(sampled, tokens)):
                lp = None
                if lps is not None and seq.params.logprobs is not None:
                    k = seq.params.logprobs
                    lp = Logprob(tok, lps[i], dict(zip(tops[0][i][:k], tops[1][i][:k])) if tops and k else {})
                self._append_token(seq, tok, lp, now)
                touched[seq.request_id] = self.requests[seq.request_id]
        self.stats["preemptions"] = self.scheduler.num_preemptions
        outputs = [self._output(r) for r in touched.values()]
        for r in touched.values():
            if r.finished:
                del self.requests[r.request_id]
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: Logprob | None, now: float) -> None:
        p = seq.params
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob.logprob
        n_out = len(seq.output_token_ids)
        if self.tokenizer is not None:
            seq.output_text = self.tokenizer.decode_incremental(seq.output_token_ids, seq.output_text,
                                                                p.skip_special_tokens)
        reason, stop_reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in p.stop_token_ids:
                reason, stop_reason = "stop", token
            elif p.stop_list:
                reason, stop_reason = self._check_stop_strings(seq)
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    @staticmethod
    def _check_stop_strings(seq: Sequence):
        text = seq.output_text
        for stop in seq.params.stop_list:
            at = text.find(stop)
            if at != -1:
                seq.output_text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
                return "stop", stop
        return None, None

    def _output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index, text=s.output_text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        first = min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": first,
                   "num_preemptions": sum(s.num_preemptions for s in req.seqs)}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             num_cached_tokens=max(s.num_cached_tokens for s in req.seqs), metrics=metrics)
