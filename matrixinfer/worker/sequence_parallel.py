"""SP-TP-SP: the paper's prefill parallelism over the P ranks of one instance.

Every rank receives the whole scheduler output. The step's tokens (every chunk, concatenated
in scheduler order) are cut into P contiguous, even slices (parallel/sequence.py); each rank
embeds and runs its slice through the layers: MLA stage 1, the MoE (the routed experts
partitioned over the P ranks, reached with issue 11's dispatch/combine) and the dense MLPs
run on the slice; attention gathers every token's latents for its own heads and
reduce-scatters o_proj back to the slices (model/attention.py). After the final norm the
ranks all-gather their rows, so the driver samples the whole batch as without parallelism.

The layout serves any step, so decode steps run the same way (one token per sequence, cut
over the ranks); every rank holds the whole latent KV cache (each writes every token's
latents), the layout the decode path and the KV connector read.

Two microbatches (`microbatches=2`): the requests are split in two by tokens (a prefix of
the batch with about half of them, split_microbatches) and each is cut over the ranks on
its own; the two run interleaved (run_microbatches) so that while one microbatch's all-gather,
reduce-scatter or expert exchange flies the other computes.
"""

from __future__ import annotations

import torch

from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.parallel.ep_comm import EPDispatcher
from matrixinfer.parallel.sequence import SequenceShards, SPStats
from matrixinfer.parallel.state import ParallelGroup
from matrixinfer.worker.data_parallel import run_microbatches, split_microbatches
from matrixinfer.worker.model_runner import ModelRunner, StepOutput


class SequenceParallelRunner(ModelRunner):
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, group: ParallelGroup,
                 dispatcher: EPDispatcher, microbatches: int = 1, balancer=None):
        super().__init__(model, num_blocks, block_size, device)
        self.group, self.dispatcher, self.microbatches = group, dispatcher, microbatches
        self.balancer = balancer  # EPLB over the SP group's experts (parallel/eplb.py), or None
        self.stats = SPStats()  # exchange waits and bytes of the attention redistributions

    def execute_model(self, sched, skip=frozenset(), driver: bool = True):
        out = super().execute_model(sched, skip, driver)
        if self.balancer is not None:
            self.balancer.end_step()  # every rank, every step: counts, and at times the experts move
        return out

    @torch.inference_mode()
    def run_step(self, reqs: list[ScheduledRequest], num_decode: int) -> StepOutput:
        rows = [(r, i < num_decode) for i, r in enumerate(reqs)]
        parts, caps, shards = [], [], []
        for mb in split_microbatches(rows, self.microbatches):
            if not mb:  # every rank sees the same split: an empty microbatch is skipped everywhere
                continue
            ids, pos, ctx = self.prepare([r for r, _ in mb], sum(1 for _, d in mb if d))
            ctx.sp = sp = SequenceShards(self.group, pos, self.stats)
            parts.append((self.model.model.stages(ids[sp.mine], pos[sp.mine]), ctx))
            caps.append(sp.shard)
            shards.append(sp)
        hidden = run_microbatches(parts, caps, self.dispatcher)
        return StepOutput(torch.cat([sp.gather_rows(h) for sp, h in zip(shards, hidden)]))
