"""The engine core: token ids in, token ids out (scheduler, KV cache manager, request state)."""

from matrixinfer.engine.core import EngineCore
from matrixinfer.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from matrixinfer.engine.sampling_params import SamplingParams

__all__ = ["EngineCore", "EngineCoreRequest", "EngineCoreOutput", "EngineCoreOutputs", "SamplingParams"]
