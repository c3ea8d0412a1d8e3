"""The in-process executor: one worker (rank 0) in the engine core's own process."""

from __future__ import annotations

from matrixinfer.config import EngineConfig
from matrixinfer.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from matrixinfer.executor.base import ExecutorInfo


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        from matrixinfer.worker.model_runner import ModelRunner
        from matrixinfer.worker.worker import Worker

        self.worker = Worker(config)
        m = self.worker.model
        self.info = ExecutorInfo(self.worker.num_blocks, self.worker.max_model_len,
                                 str(m.lm_head.weight.dtype).removeprefix("torch."), m.config.vocab_size,
                                 ModelRunner.cache_bytes_per_block(m, config.cache.block_size))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        self.worker.shutdown()
