"""One serving instance: scheduler, paged latent KV cache, model runner, sampler, offline API."""

from matrixinfer.engine.llm import DEFAULT_MODEL, LLM
from matrixinfer.engine.llm_engine import LLMEngine
from matrixinfer.engine.outputs import CompletionOutput, RequestOutput
from matrixinfer.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "DEFAULT_MODEL"]
