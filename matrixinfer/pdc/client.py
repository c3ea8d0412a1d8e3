"""The PDC front end: an EngineClient over separate prefill and decode instances.

Hand-off protocol (per sample of a request; docs/pdc.md has the failure cases):
1. The peer scheduler picks a prefill instance; it gets the request capped at one output
   token. Its KV connector saves every full block of the prompt to the EMS pool, before the
   first token comes back (saves are synchronous with the step that fills a block).
2. The first token goes to the client at once. Unless the request is over, the scheduler picks
   a decode instance and sends it prompt + the tokens so far. Its connector finds the prompt's
   full blocks in EMS (same block names, same namespace), loads them, computes the tail (less
   than one block) and goes on decoding. The prefill instance has already freed its blocks:
   nothing it holds depends on the decode side, so nothing is stranded if that side dies.
3. If an instance dies, each sample it held is sent again from where the client's stream is:
   to another prefill instance (not started) or another decode instance with prompt + every
   token already streamed, so the stream goes on without duplicated or lost tokens. With no
   instance of that role left, the request ends with a clear error.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from matrixinfer.config import EngineConfig
from matrixinfer.engine.core_client import EngineDeadError
from matrixinfer.engine.messages import EngineCoreOutputs, EngineCoreRequest
from matrixinfer.frontend.async_llm import AsyncLLM
from matrixinfer.frontend.processor import parent_id
from matrixinfer.pdc.instance import Instance
from matrixinfer.pdc.router import make_router


log = logging.getLogger(__name__)
MAX_QUICK_RESTARTS, QUICK_DEATH_S = 3, 30.0  # a crash loop is not restarted forever
HANDOFF_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class NoInstanceError(RuntimeError):
    pass


class HandoffLatency:
    """Time from a sample's first token (prefill) to its second (decode): the hand-off as
    the client sees it, including the decode instance loading the KV from EMS."""

    buckets = HANDOFF_BUCKETS

    def __init__(self):
        self.counts = [0] * len(HANDOFF_BUCKETS)
        self.total, self.sum = 0, 0.0

    def observe(self, seconds: float) -> None:
        for i, b in enumerate(HANDOFF_BUCKETS):
            if seconds <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += seconds


@dataclass
class Route:
    request: EngineCoreRequest  # the sample as the front end made it
    stage: str  # "prefill" | "decode"
    instance: Instance
    handed_at: float | None = None  # when decode took it over after the first token


class PDCClient(AsyncLLM):
    def __init__(self, prefill: list[EngineConfig], decode: list[EngineConfig], model_name: str | None = None,
                 router: str = "least-loaded", on_shutdown=None, restart_instances: bool = True, ray: bool = False):
        roles = [("prefill", i, c) for i, c in enumerate(prefill)] + [("decode", i, c) for i, c in enumerate(decode)]
        self.ray = ray
        with ThreadPoolExecutor(len(roles)) as pool:  # instances load their models in parallel
            futures = [pool.submit(Instance, *r, 0, ray) for r in roles]
            instances = []
            try:
                instances = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    if f.exception() is None:
                        f.result().shutdown()
                raise
        self.prefill = [i for i in instances if i.role == "prefill"]
        self.decode = [i for i in instances if i.role == "decode"]
        first = self.decode[0].client
        self._init_frontend(decode[0], model_name, first.max_model_len, first.vocab_size)
        self.router = make_router(router, decode[0].cache.block_size)
        self.routes: dict[str, Route] = {}
        self._on_shutdown = on_shutdown
        self.restart_instances = restart_instances
        self._closing = False
        # at interpreter exit the instances' cores are stopped: that is not a death to repair
        atexit.register(self._stop_restarting)
        self.handoff_latency = HandoffLatency()
        self.kv_bytes_per_token = first.kv_bytes_per_token
        for inst in instances:
            self._watch(inst)

    def _watch(self, inst: Instance) -> None:
        threading.Thread(target=self._dispatch_instance, args=(inst,), name=f"pdc-{inst.name}", daemon=True).start()

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode

    # -- routing --------------------------------------------------------------------------------------
    def _submit(self, reqs: list[EngineCoreRequest]) -> None:
        with self._lock:
            for r in reqs:
                self._to_prefill(r)

    def _to_prefill(self, r: EngineCoreRequest) -> None:
        alive = [i for i in self.prefill if i.alive]
        if not alive:
            raise NoInstanceError("no prefill instance is running")
        inst = self.router.choose_prefill(alive, r.prompt_token_ids, r.namespace)
        params = replace(r.params, max_tokens=1, min_tokens=min(r.params.min_tokens, 1))
        self.routes[r.request_id] = Route(r, "prefill", inst)
        self.router.observe(inst, r.prompt_token_ids, r.namespace)
        inst.add(replace(r, params=params))

    def _to_decode(self, child_id: str, tokens: list[int]) -> None:
        """Continue a sample on a decode instance after `tokens` were streamed."""
        route = self.routes[child_id]
        alive = [i for i in self.decode if i.alive]
        if not alive:
            raise NoInstanceError("no decode instance is running")
        r, n = route.request, len(tokens)
        p = r.params
        so = p.structured_outputs  # the streamed tokens become prompt there: its grammar must have read them
        params = replace(p, max_tokens=None if p.max_tokens is None else p.max_tokens - n,
                         min_tokens=max(0, p.min_tokens - n),
                         structured_outputs=None if so is None else replace(so, accepted=so.accepted + tuple(tokens)))
        inst = self.router.choose_decode(alive)
        self.routes[child_id] = Route(r, "decode", inst, time.monotonic() if n == 1 else None)
        inst.add(replace(r, prompt_token_ids=r.prompt_token_ids + tokens, params=params))

    def _abort_children(self, child_ids: list[str]) -> None:
        with self._lock:
            for cid in child_ids:
                route = self.routes.pop(cid, None)
                if route is not None:
                    route.instance.abort([cid])

    # -- outputs ----------------------------------------------------------------------------------
    def _dispatch_instance(self, inst: Instance) -> None:
        while True:
            item = inst.client.outputs.get()
            if isinstance(item, EngineDeadError):
                self._instance_died(inst)
                return
            if isinstance(item, BaseException):  # a failed step: the requests in flight there fail
                for cid in list(inst.requests):
                    self._fail_request(parent_id(cid), item)
                continue
            if isinstance(item, tuple):  # ("rejected", (engine request id, message))
                self._fail_request(parent_id(item[1][0]), ValueError(item[1][1]))
                continue
            self._instance_outputs(inst, item)

    def _instance_outputs(self, inst: Instance, out: EngineCoreOutputs) -> None:
        if out.stats is not None:
            inst.stats = out.stats
        handoff = []
        with self._lock:
            outputs = []
            for o in out.outputs:
                route = self.routes.get(o.request_id)
                if route is None or route.instance is not inst:
                    continue  # aborted, or already moved elsewhere
                if o.finished and inst.role == "prefill" and o.finish_reason == "length" and self._wants_more(route):
                    o = replace(o, finish_reason=None)  # the cap was ours: decode goes on
                    handoff.append(o.request_id)
                if inst.role == "decode":
                    o = replace(o, num_cached_tokens=0)  # the prefill stage reports what the prompt reused
                    if route.handed_at is not None and o.new_token_ids:
                        self.handoff_latency.observe(time.monotonic() - route.handed_at)
                        route.handed_at = None
                if o.finished or o.request_id in handoff:
                    inst.done(o.request_id)
                if o.finished:
                    self.routes.pop(o.request_id, None)
                outputs.append(o)
            self._on_outputs(EngineCoreOutputs(outputs))
            for cid in handoff:
                tokens = self.output_processor.streamed_tokens(cid)
                if tokens is None or cid not in self.routes:
                    continue  # finished by a stop string, or aborted, meanwhile
                inst.handed_off += 1
                try:
                    self._to_decode(cid, tokens)
                except NoInstanceError as e:
                    self._fail_request(parent_id(cid), e)

    def _wants_more(self, route: Route) -> bool:
        p, r = route.request.params, route.request
        return (p.max_tokens is None or p.max_tokens > 1) and len(r.prompt_token_ids) + 1 < self.max_model_len

    def _instance_died(self, inst: Instance) -> None:
        inst.alive = False
        if self._closing:
            return  # shutdown() stopped it
        with self._lock:
            moved = [cid for cid, route in self.routes.items() if route.instance is inst]
            inst.requests.clear()
            for cid in moved:
                route = self.routes[cid]
                tokens = self.output_processor.streamed_tokens(cid)
                try:
                    if tokens is None:
                        self.routes.pop(cid, None)
                    elif route.stage == "prefill" and not tokens:
                        self._to_prefill(route.request)
                    else:
                        self._to_decode(cid, tokens)
                except NoInstanceError as e:
                    self.routes.pop(cid, None)
                    self._fail_request(parent_id(cid), e)
        log.warning("%s (pid %d) died; %d request(s) moved", inst.name, inst.pid, len(moved))
        crash_loop = inst.restarts >= MAX_QUICK_RESTARTS and time.monotonic() - inst.started < QUICK_DEATH_S
        if crash_loop:
            log.error("%s died %d times within %.0f s of starting: not restarting it", inst.name, inst.restarts + 1,
                      QUICK_DEATH_S)
        elif self.restart_instances and not self._closing:
            threading.Thread(target=self.restart, args=(inst,), name=f"restart-{inst.name}", daemon=True).start()

    def _stop_restarting(self) -> None:
        self._closing = True

    def restart(self, inst: Instance) -> Instance:
        """Start a fresh process for a dead instance; it rejoins (same role and name) and takes load."""
        new = Instance(inst.role, inst.index, inst.config, inst.restarts + 1, self.ray)
        with self._lock:
            group = self.prefill if inst.role == "prefill" else self.decode
            group[group.index(inst)] = new
            if self._closing:
                new.shutdown()
                return new
        self._watch(new)
        log.warning("%s restarted (pid %d)", new.name, new.pid)
        return new

    def role_stats(self) -> list[dict]:
        return [i.info() for i in self.instances]

    def scheduler_stats(self):
        """The live instances' stats summed (KV usage: the fullest instance), when asked."""
        from matrixinfer.engine.messages import SchedulerStats

        live = [i.stats for i in self.instances if i.alive]
        total = SchedulerStats()
        for s in live:
            for k in ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "external_cache_hits",
                      "num_preemptions", "steps", "prefill_tokens", "decode_tokens", "spec_num_drafts",
                      "spec_num_draft_tokens", "spec_num_accepted_tokens"):
                setattr(total, k, getattr(total, k) + getattr(s, k))
            n = max(len(total.spec_accepted_per_pos), len(s.spec_accepted_per_pos))
            pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
            total.spec_accepted_per_pos = [a + b for a, b in zip(pad(total.spec_accepted_per_pos),
                                                                  pad(s.spec_accepted_per_pos))]
        total.kv_cache_usage = max((s.kv_cache_usage for s in live), default=0.0)
        return total

    def shutdown(self) -> None:
        self._closing = True
        atexit.unregister(self._stop_restarting)
        for inst in self.instances:
            inst.shutdown()
        self._fail_all(RuntimeError("the engine is shutting down"))
        if self._on_shutdown is not None:
            self._on_shutdown()
