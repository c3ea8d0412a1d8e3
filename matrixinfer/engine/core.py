"""The engine core: token ids in, token ids out. step() = schedule -> execute -> update.

It owns the scheduler (and through it the KV cache manager and the scheduler half of the KV
connector) and an executor that runs the workers. It knows nothing of text: the front end
tokenizes, detokenizes and checks stop strings.
"""

from __future__ import annotations

from matrixinfer.config import EngineConfig
from matrixinfer.engine.block_hash import model_identity
from matrixinfer.engine.kv_cache_manager import KVCacheManager
from matrixinfer.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from matrixinfer.engine.request import Request, RequestStatus
from matrixinfer.engine.scheduler import Scheduler
from matrixinfer.executor import make_executor


class EngineCore:
    def __init__(self, config: EngineConfig):
        from matrixinfer.kv_connector import make_scheduler_connector

        self.config = config
        self.executor = make_executor(config)
        info = self.executor.info
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.kv = KVCacheManager(info.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                 model_identity(config.model), info.kv_dtype)
        try:
            connector = make_scheduler_connector(config.kv_transfer, self.kv)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, connector,
                                   config.speculative.num_draft_tokens, config.decode_steps,
                                   prompts_alone=config.compiles_prefill)

    def add_request(self, r: EngineCoreRequest) -> None:
        """r was validated once, by the front end's Processor."""
        if r.request_id in self.scheduler.requests:
            raise ValueError(f"request id {r.request_id!r} is already in use")
        self.scheduler.add_request(Request(r.request_id, r.prompt_token_ids, r.params, r.namespace,
                                           r.arrival_time, tuple(r.eos_token_ids)))

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(r.request_id, [], finish_reason="abort") for r in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished():
            return EngineCoreOutputs(stats=self.scheduler.make_stats())
        sched = self.scheduler.schedule()
        outputs = []
        if sched.requests:
            out = self.executor.execute_model(sched)
            outputs = self.scheduler.update_from_output(sched, out)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def shutdown(self) -> None:
        self.executor.shutdown()
