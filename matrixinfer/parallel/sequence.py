"""Sequence shards of one SP-TP-SP step (the paper's prefill: "the tokens of all requests are
concatenated and cut evenly across devices") and the two redistributions between MLA's stages.

The step's N tokens (every scheduled chunk, concatenated in scheduler order) are cut into P
contiguous slices whose sizes differ by at most one: rank r holds `sizes[r]` = N // P (+1 for
the first N % P ranks) tokens; a rank may hold none (a prompt shorter than P). Every rank knows
the cut from the scheduler output, so no count travels. Collectives pad each slice to
`shard` = ceil(N / P) rows (gloo and NCCL want equal pieces):

- `gather` (stage 1 -> 2): all-gather of each token's stage-1 output (the normalised q latent
  and the KV latent with its roped key), so every rank holds all N tokens for its heads;
- `scatter` (stage 2 -> 3): the reduce-scatter of o_proj's per-head partial sums: rank r
  ends with the sum over ranks of its own tokens' rows.

Both are started with async_op and finished later, so a microbatch pipeline can run the
other microbatch's compute while one flies (worker/sequence_parallel.py). `stats` counts the
time spent waiting and the bytes this rank sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import torch
import torch.distributed as dist

from matrixinfer.parallel.state import ParallelGroup


def shard_sizes(n: int, p: int) -> list[int]:
    """Tokens of each of p ranks for a step of n tokens: contiguous, sizes within one."""
    base, extra = divmod(n, p)
    return [base + (r < extra) for r in range(p)]


def _waited(work) -> float:
    """Wait for an async collective; the seconds spent waiting."""
    t0 = perf_counter()
    work.wait()
    return perf_counter() - t0


@dataclass
class SPStats:
    gather_s: float = 0.0  # time waiting for all-gathers (all of the exchange when nothing overlaps)
    scatter_s: float = 0.0
    bytes_sent: int = 0  # what this rank put on the wire (padding included)
    exchanges: int = 0


@dataclass
class SequenceShards:
    """One step's cut of its tokens over the SP group, and the two redistributions."""

    group: ParallelGroup
    positions: torch.Tensor  # [N] positions of every token of the step (stage 2 ropes the queries of all)
    stats: SPStats = field(default_factory=SPStats)
    _rope: dict = field(default_factory=dict)

    def __post_init__(self):
        self.total = int(self.positions.shape[0])
        self.sizes = shard_sizes(self.total, self.group.size)
        self.starts = [sum(self.sizes[:r]) for r in range(self.group.size)]
        self.shard = self.sizes[0]

    @property
    def mine(self) -> slice:
        r = self.group.rank
        return slice(self.starts[r], self.starts[r] + self.sizes[r])

    def rope(self, rotary, dtype: torch.dtype):
        """(cos, sin) of every token's position, computed once per step (same for all layers)."""
        if dtype not in self._rope:
            self._rope[dtype] = rotary.cos_sin(self.positions, dtype)
        return self._rope[dtype]

    def _pad(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] == rows:
            return x.contiguous()
        out = x.new_zeros(rows, *x.shape[1:])
        out[: x.shape[0]] = x
        return out

    # -- stage 1 -> stage 2: every rank gets every token ----------------------------------
    def start_gather(self, x: torch.Tensor):
        """x: [sizes[rank], D] this rank's rows -> a handle for finish_gather."""
        parts = [x.new_empty(self.shard, *x.shape[1:]) for _ in range(self.group.size)]
        mine = self._pad(x, self.shard)
        work = dist.all_gather(parts, mine, group=self.group.group, async_op=True)
        self.stats.bytes_sent += mine.numel() * mine.element_size() * (self.group.size - 1)
        self.stats.exchanges += 1
        return work, parts

    def finish_gather(self, handle) -> torch.Tensor:
        """-> [N, D], all ranks' rows in token order."""
        work, parts = handle
        self.stats.gather_s += _waited(work)
        return torch.cat([p[:n] for p, n in zip(parts, self.sizes)])

    # -- stage 2 -> stage 3: partial sums of all tokens -> summed rows of this rank's tokens --
    def start_scatter(self, partial: torch.Tensor):
        """partial: [N, H] this rank's contribution for every token -> a handle for finish_scatter."""
        p, s = self.group.size, self.shard
        send = partial.new_zeros(p, s, *partial.shape[1:])
        for r in range(p):
            send[r, : self.sizes[r]] = partial[self.starts[r]: self.starts[r] + self.sizes[r]]
        out = partial.new_empty(s, *partial.shape[1:])
        work = dist.reduce_scatter_single(out, send.flatten(0, 1), group=self.group.group, async_op=True)
        self.stats.bytes_sent += send[0].numel() * send.element_size() * (p - 1)
        self.stats.exchanges += 1
        return work, out

    def finish_scatter(self, handle) -> torch.Tensor:
        """-> [sizes[rank], H]: the sum over ranks of this rank's tokens' partials."""
        work, out = handle
        self.stats.scatter_s += _waited(work)
        return out[: self.sizes[self.group.rank]]

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Blocking all-gather of this rank's rows (the final hidden states, for the driver)."""
        return self.finish_gather(self.start_gather(x))
