"""Executors run the scheduler's steps on the workers: in-process (one rank) or one OS
process per rank in a torch.distributed group."""

from matrixinfer.executor.base import make_executor
from matrixinfer.worker.worker import ExecutorInfo

__all__ = ["ExecutorInfo", "make_executor"]
