"""The synchronous engine the offline API and the benches drive: processor -> engine core
(in this process) -> output processor. add_request / step / abort_request."""

from __future__ import annotations

from matrixinfer.config import EngineConfig, ModelConfig
from matrixinfer.engine.core_client import InprocCoreClient
from matrixinfer.engine.messages import SchedulerStats
from matrixinfer.engine.sampling_params import SamplingParams
from matrixinfer.frontend.output_processor import OutputProcessor, RequestState
from matrixinfer.frontend.outputs import RequestOutput
from matrixinfer.frontend.processor import Processor
from matrixinfer.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.tokenizer = Tokenizer.maybe_load(config.model)
        self.core = InprocCoreClient(config)
        self.max_model_len = self.core.max_model_len
        self.processor = Processor(self.tokenizer, self.core.vocab_size, self.max_model_len,
                                   self.model_config.eos_token_id)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = SchedulerStats()

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, namespace: str = "",
                    arrival_time: float | None = None) -> RequestState:
        params = params or SamplingParams()
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.processor.tokenize(prompt)
        reqs = self.processor.engine_requests(request_id, ids, params, namespace, arrival_time)
        state = self.output_processor.add_request(request_id, text, ids, params, reqs[0].arrival_time)
        for r in reqs:
            self.core.add_request(r)
        return state

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.child_ids(request_id))
        self.output_processor.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        out = self.core.get_outputs()
        if out.stats is not None:
            self.stats = out.stats
        results, to_abort = self.output_processor.process(out.outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return results

    @property
    def worker(self):
        """The in-process rank-0 worker (benches and tests look at its model and runner)."""
        return self.core.core.executor.worker

    @property
    def model(self):
        """The in-process rank-0 model (benches count its bytes and FLOPs)."""
        return self.worker.model

    @property
    def scheduler(self):
        """The in-process core's scheduler (benches and tests look at its queues)."""
        return self.core.core.scheduler

    def shutdown(self) -> None:
        self.core.shutdown()
