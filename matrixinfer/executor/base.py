"""What every executor tells the engine core once its workers are up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExecutorInfo:
    num_blocks: int  # KV cache blocks on every rank
    max_model_len: int
    kv_dtype: str
    vocab_size: int
    kv_bytes_per_block: int = 0  # one block's latent KV over all layers (what a hand-off moves)
    weights: dict | None = None  # rank 0's model-cache load report (load_format "ems")


def make_executor(config):
    if config.parallel.executor_kind() == "mp":
        from matrixinfer.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from matrixinfer.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
