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
about 1/ep (a per-rank block pool in the scheduler would remove that). For the same reason
prefix caching is off with expert parallelism: a cached block lives on the rank that wrote it.

A rank with no request this step still runs every MoE layer's exchange with zero tokens (a
dummy batch), so the collectives never wait on it. After the model, the ranks all-gather their
final hidden rows so the driver samples the whole batch, as it does without parallelism.
"""

from __future__ import annotations

import torch

from matrixinfer.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from matrixinfer.model.moe import MoE
from matrixinfer.parallel.ep_comm import EPDispatcher
from matrixinfer.parallel.state import ParallelGroup
from matrixinfer.worker.model_runner import ModelRunner


class RequestPlacement:
    """Sticky, least-loaded assignment of requests to `size` data-parallel ranks."""

    def __init__(self, size: int):
        self.owner: dict[str, int] = {}
        self.live = [0] * size

    def finish(self, request_ids) -> None:
        for rid in request_ids:
            rank = self.owner.pop(rid, None)
            if rank is not None:
                self.live[rank] -= 1

    def place(self, reqs: list[ScheduledRequest]) -> list[int]:
        """The owner rank of each request (new ones placed now)."""
        for r in reqs:
            if r.request_id not in self.owner:
                rank = min(range(len(self.live)), key=self.live.__getitem__)
                self.owner[r.request_id] = rank
                self.live[rank] += 1
        return [self.owner[r.request_id] for r in reqs]


class DataParallelRunner(ModelRunner):
    """ModelRunner whose forward covers this rank's requests and returns the whole batch's
    hidden rows (gathered), so sampling and everything after it is unchanged."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 group: ParallelGroup, dispatcher: EPDispatcher, balancer=None):
        super().__init__(model, num_blocks, block_size, device)
        self.group, self.dispatcher, self.balancer = group, dispatcher, balancer
        self.placement = RequestPlacement(group.size)

    def execute_model(self, sched: SchedulerOutput, skip: set[str] = frozenset(),
                      driver: bool = True) -> ModelRunnerOutput | None:
        self.placement.finish(sched.finished_request_ids)
        out = super().execute_model(sched, skip, driver)
        if self.balancer is not None:
            self.balancer.end_step()  # every rank, every step: counts, and at times the experts move
        return out

    @torch.inference_mode()
    def run(self, reqs: list[ScheduledRequest], num_decode: int) -> torch.Tensor:
        owners = self.placement.place(reqs)
        me, size = self.group.rank, self.group.size
        tokens = [0] * size
        for r, o in zip(reqs, owners):
            tokens[o] += len(r.token_ids)
        most = max(tokens)
        self.dispatcher.set_step_tokens(most)
        mine = [r for r, o in zip(reqs, owners) if o == me]
        if mine:
            decodes = sum(1 for o in owners[:num_decode] if o == me)  # decode rows lead, in order
            hidden = super().run(mine, decodes)
        else:
            hidden = self.idle()
        padded = hidden.new_zeros(most, hidden.shape[-1])
        padded[: hidden.shape[0]] = hidden
        parts = self.group.all_gather(padded, dim=0).view(size, most, -1)
        rows, used = [], [0] * size
        for r, o in zip(reqs, owners):
            n = len(r.token_ids)
            rows.append(parts[o, used[o]: used[o] + n])
            used[o] += n
        return torch.cat(rows)

    def idle(self) -> torch.Tensor:
        """The dummy batch: every MoE layer's exchange with zero tokens, in layer order."""
        x = torch.empty(0, self.model.config.hidden_size, dtype=self.kv_cache.dtype, device=self.device)
        for layer in self.model.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp(x)
        return x
