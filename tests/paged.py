"""A test helper: run one sequence through the engine's paged path (ModelRunner over the
latent KV cache), step by step, without the scheduler."""

from __future__ import annotations

import torch

from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.worker.model_runner import ModelRunner


class PagedSequence:
    def __init__(self, model, num_blocks: int = 16, block_size: int = 4):
        self.runner = ModelRunner(model, num_blocks, block_size, torch.device("cpu"))
        self.block_table = list(range(num_blocks))
        self.num_computed = 0

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed the next tokens (a prefill chunk or one decode token); logits at the last one."""
        r = ScheduledRequest("r", list(token_ids), self.num_computed, self.block_table, sample=True)
        logits = self.runner.forward([r], int(len(token_ids) == 1), [0])[0]
        self.num_computed += len(token_ids)
        return logits
