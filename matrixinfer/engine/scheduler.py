"""Continuous batching, and every change to a request's state.

schedule(): running requests continue (one decode token each, or the next chunk of a long
prompt), then waiting ones join, under a token budget and a request cap. A joining request
first takes its locally cached prefix blocks, then asks the KV connector how many more of its
tokens the pool holds (their KV is loaded instead of computed). When blocks run out, the most
recently admitted running request is preempted: its blocks are freed and it is recomputed
later (its prefix blocks likely still cached).

update_from_output(): after the workers ran the step, advance computed counts, append sampled
tokens, check stops on token ids (eos, stop ids, max_tokens, context), free finished
requests, and turn failed KV loads into recomputation.

Speculative decoding (MTP): a decode request carries the drafts the workers proposed last step
(Request.spec_token_ids); it is scheduled with 1 + k query tokens (its last token, then the
drafts) and slots for them plus k - 1 lookahead slots (the recursive drafts write there). The
workers return the accepted drafts and one token of the target's own; the computed count then
covers only the accepted tokens, so a rejected position's slot is simply written again next
step and block names only ever cover accepted tokens.

Multi-step decode (vLLM's multi-step scheduling): when every running request decodes by the
raw argmax and none waits, one schedule covers k decode steps (SchedulerOutput.num_steps): each
request gets slots for k tokens, the worker feeds each step's greedy tokens to the next without
returning, and the k tokens come back as spec decode's accepted ones do (stops checked token by
token, the rest dropped). What it saves is the host's work around a step (schedule, inputs,
update, outputs: a quarter of a batch-1 step), k - 1 times of k. In the engine core's process a
message (a request to join, an abort) ends the run after the current step, so an arrival waits
one step, as without it.

Prompts alone (`prompts_alone`, on where the runner compiles prefill): new prompts with nothing
cached get a step of their own ahead of the running decodes, as vLLM v0's scheduler ran
prefills, instead of joining them in a mixed step. A mixed step runs eagerly; a step of whole
new prompts runs on the compiled prefill graph (512 + 64 model, bfloat16, 2 threads, one
128-token prompt beside 1 / 8 / 32 decodes: mixed 23.2 / 24.1 / 28.8 ms, alone 17.9 / 17.6 /
17.7 ms then the compiled decode step 1.2 / 3.0 / 8.2 ms), so the arrival's first token comes
sooner and the decodes' next one does too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from matrixinfer.config import SchedulerConfig
from matrixinfer.engine.kv_cache_manager import KVCacheManager
from matrixinfer.engine.messages import EngineCoreOutput, SchedulerStats
from matrixinfer.engine.request import Logprob, PromptLogprobs, Request, RequestStatus
from matrixinfer.engine.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """What a worker needs of one request for one step (no state is kept across steps on the
    workers beside per-request RNGs, so any rank can run any step)."""
    request_id: str
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool  # this step reaches the last known token: sample the next one
    params: SamplingParams | None = None  # when sample
    prompt_token_ids: list[int] | None = None  # when sample with penalties
    output_token_ids: list[int] | None = None  # when sample with penalties, min_tokens (counted) or a grammar
    eos_token_ids: tuple[int, ...] = ()
    # prompt logprobs asked (N, the top count): logits at every position of this chunk, and the
    # prompt tokens they predict (token at start_pos + 1 ...; shorter than token_ids at the prompt's end)
    prompt_logprobs: int | None = None
    next_prompt_token_ids: list[int] | None = None
    # speculative decoding: the last num_draft of token_ids are drafts to verify; spec: this row
    # samples by rejection sampling and drafts the next tokens; next_token_id: the known token
    # after token_ids (a prompt chunk that does not reach the end), what the MTP module reads there
    num_draft: int = 0
    spec: bool = False
    next_token_id: int | None = None


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest]  # the first num_decode are decode rows (one token, plus drafts)
    num_decode: int
    finished_request_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: object | None = None
    return_hidden_states: bool = False  # speculative decoding (MTP) drafts from them
    num_steps: int = 1  # > 1: every row decodes greedily for this many steps (multi-step decode)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]  # the requests that sampled, in batch order
    sampled_token_ids: list[int]
    logprobs: list[Logprob | None] | None = None
    failed_kv_load_request_ids: set[str] = field(default_factory=set)  # their scheduled tokens did not run
    hidden_states: object | None = None  # [sampling rows, hidden] final hidden states, when asked
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # request id -> this chunk's
    # speculative decoding, per request of request_ids: every token it gained this step (accepted
    # drafts, then the target's own; sampled_token_ids holds the first) and its next drafts
    new_token_ids: list[list[int]] | None = None
    draft_token_ids: list[list[int]] | None = None


class Scheduler:
    def __init__(self, sched: SchedulerConfig, kv: KVCacheManager, max_model_len: int, connector=None,
                 num_spec_tokens: int = 0, num_steps: int = 1, prompts_alone: bool = False):
        self.max_num_seqs, self.max_num_batched_tokens = sched.max_num_seqs, sched.max_num_batched_tokens
        self.num_steps = num_steps  # decode steps per schedule at most (EngineConfig.decode_steps)
        self.prompts_alone = prompts_alone  # new uncached prompts step without the decodes (module doc)
        self.num_spec_tokens = num_spec_tokens  # k drafts per decode step (0: no speculation)
        self.lookahead = max(0, num_spec_tokens - 1)  # slots past the step's tokens the drafts write
        self.max_model_len = max_model_len
        self.kv = kv
        self.connector = connector  # scheduler half of a KV connector, or None
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_ids: list[str] = []  # finished since the last schedule, for the workers
        self.stats = SchedulerStats()

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if self.connector is not None:
            self.connector.request_finished(req)  # saves are synchronous here: blocks can go at once
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self.finished_ids.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- schedule ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        if self.prompts_alone and self.waiting and self.running:
            self._admit_waiting(budget, scheduled, alone=True)
            if scheduled:
                return self._output(scheduled, drafts, 1)
        steps = self._multi_steps()
        # 1. running requests, oldest first; preempt from the tail when blocks run out
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget == 0:  # preempted by an earlier one
                continue
            uncomputed = req.num_uncomputed
            want = min(uncomputed, budget)
            d = drafts[req.request_id] = (self._drafts(req, budget - want)
                                          if self.num_spec_tokens and want == uncomputed == 1 else [])
            if steps > 1 and not self.kv.allocate_slots(req, steps):
                steps = 1  # no room for the lookahead: one step, no preemption for it (blocks taken stay in use)
            while not self.kv.allocate_slots(req, want + len(d) + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                scheduled.pop(victim.request_id, None)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            scheduled[req.request_id] = want
            budget -= want + len(d)
        # 2. waiting requests join while there is budget, room and cache
        self._admit_waiting(budget, scheduled)
        return self._output(scheduled, drafts, steps)

    def _admit_waiting(self, budget: int, scheduled: dict[str, int], alone: bool = False) -> None:
        """Waiting requests join, oldest first, while there is budget, room and cache. `alone`
        (a step of prompts without the decodes): only prompts with nothing cached, each leaving a
        free block per running request (their next tokens need room before any preemption)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # a cached prefix has no logits: a request wanting prompt logprobs computes its prompt
            needs_logits = req.prompt_logprobs is not None
            blocks, num_local = ([], 0) if needs_logits else self.kv.get_computed_blocks(req)
            num_external = 0
            if (self.connector is not None and not needs_logits and not req.kv_load_failed
                    and req.num_cached_tokens < 0):
                num_external = self.connector.get_num_new_matched_tokens(req, num_local)
            want = min(req.num_tokens - num_local - num_external, budget)
            if alone and (num_local or num_external
                          or -(-(want + self.lookahead) // self.kv.block_size) + len(self.running)
                          > self.kv.num_free_blocks):
                break  # it joins the next, mixed step
            if not self.kv.allocate_slots(req, want + self.lookahead, blocks, num_external):
                if not self.running and not scheduled:
                    raise RuntimeError(f"a request of {req.num_tokens} tokens does not fit in the KV cache "
                                       f"({self.kv.num_blocks} blocks of {self.kv.block_size})")
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_local + num_external
                self.stats.external_cache_hits += num_external
            req.num_computed_tokens = num_local + num_external
            req.num_external_tokens = num_external
            if num_external:
                self.connector.update_state_after_alloc(req, num_local, num_external)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = want
            budget -= want

    def _output(self, scheduled: dict[str, int], drafts: dict[str, list[int]], steps: int) -> SchedulerOutput:
        # decode rows first: the runner serves them with the batched absorbed-MLA path
        reqs = sorted((r for r in self.running if r.request_id in scheduled),
                      key=lambda r: scheduled[r.request_id] != 1)
        out = SchedulerOutput([self._scheduled(r, scheduled[r.request_id], drafts.get(r.request_id, []))
                               for r in reqs],
                              num_decode=sum(1 for r in reqs if scheduled[r.request_id] == 1),
                              finished_request_ids=self.finished_ids, num_steps=steps)
        self.finished_ids = []
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out, [self.requests[r.request_id] for r in out.requests])
        return out

    def _multi_steps(self) -> int:
        """The decode steps this schedule covers: num_steps when every running request decodes
        one token by the raw argmax and none waits (a prompt would wait behind them), no more
        than any request's room (max_tokens, the context); else 1."""
        k = self.num_steps
        if k == 1 or self.waiting or not self.running or len(self.running) > self.max_num_batched_tokens:
            return 1
        for req in self.running:
            n_out = len(req.output_token_ids)
            if req.num_uncomputed != 1 or not req.params.takes_argmax(n_out):
                return 1
            k = min(k, self.max_model_len - req.num_tokens)
            if req.params.max_tokens is not None:
                k = min(k, req.params.max_tokens - n_out)
        return max(k, 1)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The drafts a decode request verifies this step: its proposals, as many as fit the
        budget, the context and max_tokens (a token past those would be dropped anyway)."""
        p = req.params
        room = min(budget, self.max_model_len - req.num_tokens)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
        return req.spec_token_ids[:max(0, room)]

    def _speculates(self, req: Request) -> bool:
        """Whether req samples by verification and drafting: sampling that depends on nothing
        but the logits (logprobs, penalties, logit bias and min_tokens take the plain sampler)."""
        return self.num_spec_tokens > 0 and req.params.logits_alone(len(req.output_token_ids))

    def _scheduled(self, req: Request, n: int, drafts: list[int] = ()) -> ScheduledRequest:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        penalties = sample and req.params.has_penalties
        # the output so far: penalties and min_tokens count it, a grammar's matcher advances by it
        counted = penalties or (sample and (req.params.min_tokens > 0 or req.params.structured_outputs is not None))
        s = ScheduledRequest(
            req.request_id, req.token_ids_between(start, start + n) + list(drafts), start, list(req.block_table), sample,
            req.params if sample else None,
            req.prompt_token_ids if penalties else None, req.output_token_ids if counted else None,
            req.eos_token_ids if sample else (), num_draft=len(drafts), spec=sample and self._speculates(req),
            next_token_id=None if sample or not self.num_spec_tokens else req.token_ids_between(start + n, start + n + 1)[0])
        if req.prompt_logprobs is not None and start < len(req.prompt_token_ids):
            s.prompt_logprobs = req.params.prompt_logprobs
            s.next_prompt_token_ids = req.prompt_token_ids[start + 1:start + n + 1]
        return s

    # -- update -----------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        # the decode steps that ran: a multi-step run may end early (ModelRunner.interrupt)
        ran = len(out.new_token_ids[0]) if sched.num_steps > 1 and out.new_token_ids else 1
        self.stats.steps += ran
        for s in sched.requests:
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            if s.request_id in out.failed_kv_load_request_ids:
                # the loaded prefix is not trusted: recompute it (blocks stay allocated)
                req.num_computed_tokens -= req.num_external_tokens
                req.num_cached_tokens -= req.num_external_tokens
                self.stats.external_cache_hits -= req.num_external_tokens
                req.num_external_tokens, req.kv_load_failed = 0, True
                continue
            req.num_external_tokens = 0
            n = len(s.token_ids) - s.num_draft  # the drafts count as computed once accepted
            is_decode = n == 1 and req.output_token_ids
            self.stats.decode_tokens += n + s.num_draft + ran - 1 if is_decode else 0
            self.stats.prefill_tokens += 0 if is_decode else n
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
            if s.request_id in out.prompt_logprobs and req.prompt_logprobs is not None:
                req.prompt_logprobs.put(s.start_pos, out.prompt_logprobs[s.request_id])
        outputs = []
        logprobs = out.logprobs or [None] * len(out.request_ids)
        new_tokens = out.new_token_ids or [[t] for t in out.sampled_token_ids]
        drafts = out.draft_token_ids or [[] for _ in out.request_ids]
        num_draft = {s.request_id: s.num_draft for s in sched.requests}
        for rid, tokens, lp, draft in zip(out.request_ids, new_tokens, logprobs, drafts):
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if num_draft.get(rid):
                self._count_acceptance(num_draft[rid], len(tokens) - 1)
            status, kept = None, []
            for token in tokens:  # stops are checked token by token: the rest is dropped
                req.output_token_ids.append(token)
                kept.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if status is not None:
                self.running.remove(req)
                self._free(req, status)
            else:
                req.num_computed_tokens += len(tokens) - 1  # the accepted drafts' KV is in place
                req.spec_token_ids = draft
                if len(tokens) > 1:
                    self.kv.cache_full_blocks(req)
            outputs.append(EngineCoreOutput(
                rid, kept, None if lp is None else [lp], None if status is None else status.value,
                req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0), num_preemptions=req.num_preemptions,
                prompt_logprobs=req.prompt_logprobs))
            req.prompt_logprobs = None  # sent once, with the first token
        return outputs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p, n_out = req.params, len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _count_acceptance(self, num_draft: int, num_accepted: int) -> None:
        s = self.stats
        s.spec_num_drafts += 1
        s.spec_num_draft_tokens += num_draft
        s.spec_num_accepted_tokens += num_accepted
        if len(s.spec_accepted_per_pos) < num_draft:
            s.spec_accepted_per_pos = s.spec_accepted_per_pos + [0] * (num_draft - len(s.spec_accepted_per_pos))
        for i in range(num_accepted):
            s.spec_accepted_per_pos[i] += 1

    def make_stats(self) -> SchedulerStats:
        s = self.stats
        s.num_running, s.num_waiting, s.kv_cache_usage = len(self.running), len(self.waiting), self.kv.usage
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.prefix_queries, self.kv.prefix_hits
        return SchedulerStats(**{**s.__dict__, "spec_accepted_per_pos": list(s.spec_accepted_per_pos)})
