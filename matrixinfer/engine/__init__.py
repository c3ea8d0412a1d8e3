"""The engine core: token ids in, token ids out (scheduler, KV cache manager, request state).

The package imports nothing on its own: workers import `engine.request` and
`engine.scheduler` for their message types, and an eager `engine.core` here would pull the
executor (and through it the workers) back in while they are half-loaded. The names below
load on first use."""

import importlib

_EXPORTS = {
    "EngineCore": "matrixinfer.engine.core",
    "EngineCoreRequest": "matrixinfer.engine.messages",
    "EngineCoreOutput": "matrixinfer.engine.messages",
    "EngineCoreOutputs": "matrixinfer.engine.messages",
    "SamplingParams": "matrixinfer.engine.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'matrixinfer.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
