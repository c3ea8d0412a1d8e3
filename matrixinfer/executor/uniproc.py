"""The in-process executor: one worker (rank 0) in the engine core's own process."""

from __future__ import annotations

from matrixinfer.config import EngineConfig
from matrixinfer.engine.scheduler import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        from matrixinfer.worker.worker import Worker

        self.worker = Worker(config)
        self.info = self.worker.info()

    def set_interrupt(self, interrupt) -> None:
        """A multi-step decode run ends after the step in which interrupt() says so."""
        self.worker.runner.interrupt = interrupt

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        self.worker.shutdown()
