"""The front end: text in and out (tokenize and validate once, detokenize incrementally, stop
strings), the offline `LLM` API and the async client the HTTP server uses."""

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.frontend.llm import LLM
from matrixinfer.frontend.llm_engine import LLMEngine
from matrixinfer.frontend.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "DEFAULT_MODEL"]
