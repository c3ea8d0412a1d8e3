"""The offline API, as in vLLM: `LLM(model=DIR, **engine args).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from matrixinfer.config import DEFAULT_MODEL, EngineConfig
from matrixinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from matrixinfer.frontend.llm_engine import LLMEngine
from matrixinfer.frontend.outputs import RequestOutput


class LLM:
    """Engine arguments are vLLM's names: dtype, device, seed, block_size, num_blocks,
    enable_prefix_caching, kv_cache_memory_gb, max_num_seqs, max_num_batched_tokens,
    max_model_len, tensor_parallel_size, distributed_executor_backend, kv_transfer_config
    (e.g. {"connector": "ems", "ems_controller": "HOST:PORT"})."""

    def __init__(self, model: str | Path = DEFAULT_MODEL, engine_config: EngineConfig | None = None, **engine_args):
        self.engine = LLMEngine(engine_config or EngineConfig.from_kwargs(str(model), **engine_args))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, namespace: str = "") -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # one output per request, when it finishes (the caller sees nothing sooner)
        final = {}
        params = [final.setdefault(id(p), dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
                  for p in params]
        ids = [str(next(self._counter)) for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p, namespace=namespace)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]

    def generate_stream(self, prompt, sampling_params: SamplingParams | None = None,
                        namespace: str = "") -> Iterator[RequestOutput]:
        """Yields the request's cumulative output after every step that changed it."""
        rid = str(next(self._counter))
        self.engine.add_request(rid, prompt, sampling_params or SamplingParams(), namespace=namespace)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
