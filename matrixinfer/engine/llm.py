"""The offline API, as in vLLM: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from matrixinfer.config import CacheConfig, SchedulerConfig
from matrixinfer.engine.llm_engine import LLMEngine
from matrixinfer.engine.outputs import RequestOutput
from matrixinfer.engine.sampling_params import SamplingParams

DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe")


class LLM:
    def __init__(self, model: str | Path = DEFAULT_MODEL, dtype: str = "auto", device: str = "cpu",
                 block_size: int = 16, num_blocks: int | None = None, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 kv_cache_memory_gb: float = 1.0, seed: int = 0):
        self.engine = LLMEngine(
            model, dtype=dtype, device=device,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            kv_cache_memory_gb=kv_cache_memory_gb, seed=seed,
        )
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
        ids = [str(next(self._counter)) for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, p, namespace=namespace)
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
