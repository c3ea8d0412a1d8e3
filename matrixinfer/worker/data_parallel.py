"""Attention data parallelism under expert parallelism (the paper's decode: DP320 + EP320).

Every EP rank receives the whole scheduler output (one scheduler, one engine core), runs
attention and the shared experts for its own requests only, and meets the other ranks in each
MoE layer's dispatch/combine (parallel/ep_comm.py). Which rank owns a request is decided on
every rank by the same deterministic rule from the same inputs, so no rank tells another:
a request seen for the first time goes to the rank with the fewest live requests (lowest rank
on a tie) and stays there until it finishes (sticky: its KV is there).

KV cache: every rank allocates the same pool and the scheduler's block ids mean the same slots
on every rank, but a rank only writes and reads the blocks of its own requests. Simple and
exact; the cost is memory: each rank holds a pool as large as the whole instance's, used at
about 1/ep (a per-rank block pool in the scheduler would remove that). Prefix caching works:
a cached block lives on the rank that wrote it, so a request that starts with a prefix hit is
placed on the rank that wrote its first block (every rank keeps the same block -> writer map
from the same scheduler outputs), as SGLang's data-parallel router sends a request to the
replica holding its prefix. The blocks a prefix shares stay on one rank: a hot prefix loads
that rank more (least-loaded placement still spreads requests without a hit).
The EMS KV connector works: loads go into every rank's pool (only the owner reads them: the
cost is ep x the load traffic), and each replica saves the blocks of its own requests.

A rank with no request this step still runs every MoE layer's exchange with zero tokens (a
dummy batch), so the collectives never wait on it. After the model, the ranks all-gather their
final hidden rows so the driver samples the whole batch, as it does without parallelism.
"""

from __future__ import annotations

import torch

from matrixinfer.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from matrixinfer.model.context import forward_context
from matrixinfer.parallel.ep_comm import EPDispatcher
from matrixinfer.parallel.state import ParallelGroup
from matrixinfer.worker.model_runner import ModelRunner, StepOutput


class RequestPlacement:
    """Sticky assignment of requests to `size` data-parallel ranks: a request that starts from
    cached blocks to the rank that wrote them, any other to the least-loaded rank."""

    def __init__(self, size: int):
        self.owner: dict[str, int] = {}
        self.live = [0] * size
        self.writer: dict[int, int] = {}  # KV block id -> the rank whose pool holds its latents

    def finish(self, request_ids) -> None:
        for rid in request_ids:
            rank = self.owner.pop(rid, None)
            if rank is not None:
                self.live[rank] -= 1

    def place(self, reqs: list[ScheduledRequest]) -> list[int]:
        """The owner rank of each request (new ones placed now); the blocks each one's table
        holds are its owner's from here on (it reads or writes them there)."""
        for r in reqs:
            if r.request_id not in self.owner:
                cached = r.start_pos > 0 and r.block_table and r.block_table[0] in self.writer
                rank = self.writer[r.block_table[0]] if cached else min(range(len(self.live)), key=self.live.__getitem__)
                self.owner[r.request_id] = rank
                self.live[rank] += 1
            for b in r.block_table:
                self.writer[b] = self.owner[r.request_id]
        return [self.owner[r.request_id] for r in reqs]


class DataParallelRunner(ModelRunner):
    """ModelRunner whose forward covers this rank's requests and returns the whole batch's
    hidden rows (gathered), so sampling and everything after it is unchanged."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 group: ParallelGroup, dispatcher: EPDispatcher, balancer=None, microbatches: int = 1):
        super().__init__(model, num_blocks, block_size, device)
        self.group, self.dispatcher, self.balancer = group, dispatcher, balancer
        self.microbatches = microbatches
        self.placement = RequestPlacement(group.size)

    def execute_model(self, sched: SchedulerOutput, skip: set[str] = frozenset(),
                      driver: bool = True) -> ModelRunnerOutput | None:
        self.placement.finish(sched.finished_request_ids)
        self.own_blocks: set[int] = set()  # the KV blocks this rank's requests use this step
        out = super().execute_model(sched, skip, driver)
        if self.balancer is not None:
            self.balancer.end_step()  # every rank, every step: counts, and at times the experts move
        return out

    @torch.inference_mode()
    def run_step(self, reqs: list[ScheduledRequest], num_decode: int) -> StepOutput:
        owners = self.placement.place(reqs)
        me, size = self.group.rank, self.group.size
        per_rank = [[(r, i < num_decode) for i, (r, o) in enumerate(zip(reqs, owners)) if o == rank]
                    for rank in range(size)]
        # each rank's microbatches (one, or a token-balanced split in two), known to every rank
        splits = [split_microbatches(mine, self.microbatches) for mine in per_rank]
        caps = [max(_tokens(s[m]) for s in splits) for m in range(self.microbatches)]
        self.own_blocks = {b for r, _ in per_rank[me] for b in r.block_table}
        parts = []
        for m, mb in enumerate(splits[me]):
            if mb:
                ids, pos, ctx = self.prepare([r for r, _ in mb], sum(1 for _, d in mb if d))
                parts.append((self.model.model.stages(ids, pos), ctx))
            else:  # nothing here: the exchanges with zero rows (a dummy batch)
                parts.append((self.model.model.idle_stages(self.kv_cache.dtype, self.device), None))
        hidden = torch.cat(run_microbatches(parts, caps, self.dispatcher))
        most = max(_tokens(sum(s, [])) for s in splits)
        padded = hidden.new_zeros(most, hidden.shape[-1])
        padded[: hidden.shape[0]] = hidden
        gathered = self.group.all_gather(padded, dim=0).view(size, most, -1)
        rows, used = [], [0] * size
        for r, o in zip(reqs, owners):
            n = len(r.token_ids)
            rows.append(gathered[o, used[o]: used[o] + n])
            used[o] += n
        return StepOutput(torch.cat(rows))


def run_microbatches(parts: list, caps: list[int], dispatcher: EPDispatcher) -> list[torch.Tensor]:
    """parts: (stages generator, ForwardContext or None) per microbatch; caps: the most tokens
    any rank has in each. Run the stages in turn: while one microbatch's exchange is in flight
    the other computes (its attention, or its experts). Every rank interleaves identically, so
    the collectives meet in the same order everywhere. Returns each microbatch's output."""
    results: list = [None] * len(parts)
    live = list(range(len(parts)))
    while live:
        for m in list(live):
            stages, ctx = parts[m]
            dispatcher.set_step_tokens(caps[m])
            with forward_context(ctx):
                try:
                    next(stages)
                except StopIteration as done:
                    results[m] = done.value
                    live.remove(m)
    return results


def _tokens(mb: list) -> int:
    return sum(len(r.token_ids) for r, _ in mb)


def split_microbatches(mine: list, n: int) -> list[list]:
    """n = 1: [mine]. n = 2: a prefix holding about half the tokens, and the rest (either may be
    empty); order is kept, so decode rows still lead each part."""
    if n == 1:
        return [mine]
    if not mine:
        return [[], []]
    prefix = [0]
    for r, _ in mine:
        prefix.append(prefix[-1] + len(r.token_ids))
    j = min(range(1, len(mine) + 1), key=lambda j: (abs(2 * prefix[j] - prefix[-1]), j))
    return [mine[:j], mine[j:]]
