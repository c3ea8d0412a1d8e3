"""Continuous batching: every step, running sequences continue (one decode token each, or the
next chunk of a long prompt) and waiting ones join, under a token budget and a sequence cap.
When cache blocks run out, the most recently admitted running sequence is preempted: its
blocks are freed and it is recomputed later (its prefix blocks likely still cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from matrixinfer.engine.block_manager import BlockManager
from matrixinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # decode-like (1 token) first, then prefill chunks
    num_tokens: list[int]

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}
        # 1. running sequences, oldest first; preempt from the tail when blocks run out
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            want = min(seq.num_uncomputed, budget)
            while (got := self.block_manager.allocate(seq, want)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                scheduled.pop(victim.seq_id, None)
                if victim is seq:
                    break
            if got is None:
                continue
            scheduled[seq.seq_id] = got
            budget -= got
        # 2. waiting sequences join while there is budget, room and cache
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            want = min(seq.num_uncomputed, budget)
            got = self.block_manager.allocate(seq, want)
            if got is None:
                if not self.running and not scheduled:
                    raise RuntimeError(
                        f"sequence of {len(seq)} tokens does not fit in the KV cache "
                        f"({len(self.block_manager.blocks)} blocks of {self.block_manager.block_size})"
                    )
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = got
            budget -= got
        seqs = [s for s in self.running if s.seq_id in scheduled]
        seqs.sort(key=lambda s: scheduled[s.seq_id] != 1)  # one-token queries first (absorbed decode path)
        return ScheduledBatch(seqs, [scheduled[s.seq_id] for s in seqs])

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
