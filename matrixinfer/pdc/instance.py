"""One prefill or decode instance as the front end sees it: an engine core in a process of its
own (titled `matrixinfer::prefill-0`, `matrixinfer::decode-1`, ...), the engine requests it
holds, and the load the peer scheduler reads."""

from __future__ import annotations

import time

from matrixinfer.config import EngineConfig
from matrixinfer.engine.core_client import MPCoreClient
from matrixinfer.engine.messages import EngineCoreRequest, SchedulerStats


class Instance:
    def __init__(self, role: str, index: int, config: EngineConfig, restarts: int = 0, ray: bool = False):
        self.role, self.index, self.config, self.restarts, self.ray = role, index, config, restarts, ray
        self.started = time.monotonic()
        self.name = f"{role}-{index}"
        title = f"matrixinfer::{self.name}"
        if ray:  # an actor on whichever node Ray picks
            from matrixinfer.pdc.ray_placement import RayCoreClient

            self.client = RayCoreClient(config, title)
        else:
            self.client = MPCoreClient(config, title=title)
        self.alive = True
        self.requests: dict[str, int] = {}  # engine request id -> its prompt tokens (queued work)
        self.stats = SchedulerStats()
        self.handed_off = 0  # requests this (prefill) instance passed to decode

    @property
    def pid(self) -> int:
        return self.client.pid

    def info(self) -> dict:
        """What /health and /metrics show of this instance."""
        s = self.stats
        return {"role": self.role, "instance": self.name, "alive": self.alive, "pid": self.pid,
                "requests": self.num_requests, "queued_prompt_tokens": self.queued_prompt_tokens,
                "running": s.num_running, "waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "handed_off": self.handed_off, "kv_loaded_tokens": s.external_cache_hits, "restarts": self.restarts,
                "start_seconds": self.client.start_seconds, "weights": self.client.weights_report}

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(self.requests.values())

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def add(self, req: EngineCoreRequest) -> None:
        self.requests[req.request_id] = len(req.prompt_token_ids)
        self.client.add_request(req)

    def done(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)
        if self.alive and request_ids:
            try:
                self.client.abort_requests(request_ids)
            except OSError:
                pass  # it died: its dispatcher is about to say so

    def shutdown(self) -> None:
        self.alive = False
        self.client.shutdown()
