"""The executor for a configuration: in-process for one rank, one OS process per rank otherwise.
What every executor tells the engine core once its workers are up is the workers' own
ExecutorInfo (worker/worker.py): the executors sit above the workers they drive."""

from __future__ import annotations


def make_executor(config):
    if config.parallel.executor_kind() == "mp":
        from matrixinfer.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from matrixinfer.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
