"""The engine core in a process of its own: it runs below the front end's priority and does
not outlive a front end that dies while it starts."""

import os

from matrixinfer.config import EngineConfig
from matrixinfer.engine.core_client import MPCoreClient
from matrixinfer.engine.messages import EngineCoreRequest
from matrixinfer.engine.sampling_params import SamplingParams


def test_the_core_process_runs_at_the_configured_niceness(text_checkpoint):
    """engine_core_nice lowers the core's priority relative to ours (so the front end that streams
    its tokens preempts it), and the core still computes."""
    config = EngineConfig.from_kwargs(str(text_checkpoint[0]), dtype="float32", block_size=4, max_model_len=64,
                                      engine_core_nice=7, enforce_eager=True)
    client = MPCoreClient(config)
    try:
        client.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)))
        tokens = []
        while len(tokens) < 2:
            out = client.outputs.get(timeout=60)
            tokens += [t for o in out.outputs for t in o.new_token_ids]
        want = min(19, os.nice(0) + 7)  # niceness adds to the parent's
        assert os.getpriority(os.PRIO_PROCESS, client.pid) == want  # the core's main thread
    finally:
        client.shutdown()
