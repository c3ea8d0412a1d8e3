"""Discrete-event simulation of the PDC serving system with SimPy.

Entities are plain classes (Request, EMSPool, PrefillInstance, DecodeInstance); their
lives are SimPy processes (generator functions). Step times come from outside as plain
functions, by default from the cost model (CostModelTimes), so the queueing machinery can
be checked on its own against textbook queues.

Path of a request: arrival -> least-loaded prefill instance (EMS lookup of its prefix,
compute the rest, batch up to a token budget) -> KV hand-off -> least-loaded decode
instance (continuous batching, MTP) -> done.
"""

from __future__ import annotations

import csv
import hashlib
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import simpy

from matrixinfer.sim.costs import BYTES
from matrixinfer.sim.decode import DecodeConfig, decode_step
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec
from matrixinfer.sim.prefill import PrefillConfig, page_read_gb_s, prefill_batch


@dataclass
class Request:
    rid: int
    arrival: float
    prompt_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    cached_tokens: int = 0
    prefill_start: float | None = None
    first_token: float | None = None
    done: float | None = None
    generated: int = 0
    resumed: int = 0  # tokens generated before its instance failed: re-prefilled with the prompt

    @property
    def prefill_len(self) -> int:
        """Tokens a prefill of this request processes: the prompt, plus the output so far after a loss."""
        return self.prompt_len + self.resumed

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.output_len <= 1:
            return None
        return (self.done - self.first_token) / (self.output_len - 1)


def poisson_requests(rate: float, n: int, prompt_len: int | Callable[[random.Random], int],
                     output_len: int | Callable[[random.Random], int], seed: int = 0,
                     prefixes: int = 0, prefix_len: int = 0) -> list[Request]:
    """n requests with exponential inter-arrival times (rate per second). With `prefixes` > 0
    each request starts with one of that many shared prefixes of `prefix_len` tokens."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        p = prompt_len(rng) if callable(prompt_len) else prompt_len
        o = output_len(rng) if callable(output_len) else output_len
        pid = f"p{rng.randrange(prefixes)}" if prefixes else None
        out.append(Request(i, t, p, o, pid, min(prefix_len, p) if pid else 0))
    return out


def load_trace(path: str | Path) -> list[Request]:
    """CSV with a header: arrival,prompt_len,output_len[,prefix_id,prefix_len] (seconds, tokens)."""
    reqs = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            try:
                reqs.append(Request(i, float(row["arrival"]), int(row["prompt_len"]), int(row["output_len"]),
                                    row.get("prefix_id") or None, int(row.get("prefix_len") or 0)))
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}: row {i + 2}: {e}") from None
    return sorted(reqs, key=lambda r: r.arrival)


class EMSPool:
    """Context cache: prefix id -> cached tokens, LRU over a token capacity, sharded over
    `servers` MP servers (rendezvous hashing; each holds capacity / servers).

    A failed server loses its shard. Until it is detected its keys miss and puts of them are
    dropped (clients back off); once the view drops it, its keys map to the next server in
    their order (empty there: misses until re-put); a restored server rejoins empty. Misses of
    keys a failure took count as `fault_miss_tokens` (their prefix is prefilled again)."""

    def __init__(self, capacity_tokens: int, servers: int = 1):
        self.capacity, self.servers = capacity_tokens, servers
        self.shards: list[OrderedDict[str, int]] = [OrderedDict() for _ in range(servers)]
        self.used = [0] * servers
        self.state = ["up"] * servers  # up | lost (failed, not yet detected) | out (dropped from the view)
        self.lost_ids: set[str] = set()
        self.hits = self.lookups = self.fault_miss_tokens = 0
        self._orders: dict[str, list[int]] = {}

    @property
    def entries(self) -> OrderedDict[str, int]:
        return self.shards[0]

    def home(self, prefix_id: str) -> int:
        """The first server of the key's rendezvous order still in the view."""
        if self.servers == 1:
            return 0
        order = self._orders.get(prefix_id)
        if order is None:
            w = [hashlib.blake2b(f"{prefix_id}/{k}".encode(), digest_size=8).digest() for k in range(self.servers)]
            order = self._orders[prefix_id] = sorted(range(self.servers), key=w.__getitem__, reverse=True)
        return next((k for k in order if self.state[k] != "out"), 0)

    def lookup(self, req: Request) -> int:
        if req.prefix_id is None:
            return 0
        self.lookups += 1
        k = self.home(req.prefix_id)
        shard = self.shards[k]
        if self.state[k] == "up" and req.prefix_id in shard:
            shard.move_to_end(req.prefix_id)
            self.hits += 1
            return shard[req.prefix_id]
        if req.prefix_id in self.lost_ids:
            self.fault_miss_tokens += req.prefix_len
        return 0

    def insert(self, req: Request) -> None:
        if req.prefix_id is None or req.prefix_len == 0:
            return
        k = self.home(req.prefix_id)
        shard, cap = self.shards[k], self.capacity // self.servers
        if self.state[k] != "up" or req.prefix_id in shard:
            return
        while self.used[k] + req.prefix_len > cap and shard:
            _, n = shard.popitem(last=False)
            self.used[k] -= n
        if req.prefix_len <= cap:
            shard[req.prefix_id] = req.prefix_len
            self.used[k] += req.prefix_len
            self.lost_ids.discard(req.prefix_id)

    def fail_server(self, k: int) -> None:
        self.lost_ids.update(self.shards[k])
        self.shards[k].clear()
        self.used[k] = 0
        self.state[k] = "lost"

    def detect_server(self, k: int) -> None:
        self.state[k] = "out"

    def restore_server(self, k: int) -> None:
        self.state[k] = "up"
        # keys re-put elsewhere meanwhile now map back here, where they are not
        self.lost_ids.update(pid for j, sh in enumerate(self.shards) if j != k for pid in sh if self.home(pid) == k)


@dataclass
class Chunk:
    """Part of a prompt prefilled in one step (chunked prefill): `prompt_len` tokens after
    `prefix_done` tokens of the same prompt whose KV is already in HBM."""

    req: Request
    prompt_len: int
    prefix_done: int
    cached_tokens: int = 0

    @property
    def prefill_len(self) -> int:
        return self.prompt_len


class PrefillInstance:
    """Batches queued prompts up to a token budget (or chunks of them) and takes the cost
    model's time for each batch. It can fail (`fail`: the batch in flight is lost), hand back
    what it held once the failure is detected (`evacuate`) and come back (`restore`)."""

    def __init__(self, env: simpy.Environment, name: str, step_time: Callable[[list[Request]], float],
                 ems: EMSPool | None, on_done: Callable[[Request], None], token_budget: int, max_requests: int,
                 chunk_tokens: int = 0):
        self.env, self.name, self.step_time, self.ems, self.on_done = env, name, step_time, ems, on_done
        self.token_budget, self.max_requests, self.chunk_tokens = token_budget, max_requests, chunk_tokens
        self.queue: simpy.Store = simpy.Store(env)
        self.queued_tokens = 0
        self.busy = False
        self.busy_time = 0.0
        self.tokens_emitted = self.wasted = 0
        self.up = self.known_down = False
        self.restore()

    def submit(self, req: Request) -> None:
        self.queued_tokens += req.prefill_len
        self.queue.put(req)

    def _next(self):
        """Wait for the head of the queue (the pending get is kept so that a failure can cancel it)."""
        self._get = self.queue.get()
        head = yield self._get
        self._get = None
        return head

    def run(self):
        try:
            if self.chunk_tokens:
                yield from self.run_chunked()
            while True:
                batch = self.current = [(yield from self._next())]
                tokens = batch[0].prefill_len
                while self.queue.items and len(batch) < self.max_requests \
                        and tokens + self.queue.items[0].prefill_len <= self.token_budget:
                    req = self.queue.items.pop(0)
                    batch.append(req)
                    tokens += req.prefill_len
                for r in batch:
                    r.prefill_start = self.env.now
                    r.cached_tokens = self.ems.lookup(r) if self.ems else 0
                self.busy = True
                t = self.step_time(batch)
                yield self.env.timeout(t)
                self.busy = False
                self.busy_time += t
                self.current = []
                for r in batch:
                    self.queued_tokens -= r.prefill_len
                    self._finish(r)
        except simpy.Interrupt:
            return

    def _finish(self, r: Request) -> None:
        if r.first_token is None:
            r.first_token = self.env.now
        self.tokens_emitted += 1
        if self.ems:
            self.ems.insert(r)
        self.on_done(r)

    def run_chunked(self):
        """Chunked prefill: each step takes up to `chunk_tokens` tokens from the head of the
        queue, splitting a long prompt over several steps; a request's first token comes with
        its last chunk. A cached prefix is looked up once, before its first chunk."""
        progress = self.progress = {}  # rid -> prompt tokens already prefilled
        while True:
            head = yield from self._next()
            self.queue.items.insert(0, head)
            pieces, budget = [], self.chunk_tokens
            for r in list(self.queue.items):
                if budget <= 0 or len(pieces) >= self.max_requests:
                    break
                if r.rid not in progress:
                    r.prefill_start = self.env.now
                    r.cached_tokens = self.ems.lookup(r) if self.ems else 0
                    progress[r.rid] = 0
                done = progress[r.rid]
                first = done == 0
                take = min(budget, r.prefill_len - done - (r.cached_tokens if first else 0))
                pieces.append(Chunk(r, take + (r.cached_tokens if first else 0), done,
                                    r.cached_tokens if first else 0))
                budget -= take
            self.busy, self.current = True, pieces
            t = self.step_time(pieces)
            yield self.env.timeout(t)
            self.busy, self.current = False, []
            self.busy_time += t
            for c in pieces:
                r = c.req
                progress[r.rid] = c.prefix_done + c.prompt_len
                if progress[r.rid] >= r.prefill_len:
                    self.queue.items.remove(r)
                    del progress[r.rid]
                    self.queued_tokens -= r.prefill_len
                    self._finish(r)

    def fail(self) -> None:
        """Stop at once: the batch (or chunks) in flight and the KV of half-prefilled prompts are lost."""
        if self.up:
            self.proc.interrupt()
            if self.busy:
                self.wasted += sum(c.prefill_len - c.cached_tokens for c in self.current)
            self.wasted += sum(self.progress.values())
        self.up = self.busy = False
        g, self._get = self._get, None
        if g is not None:  # a head taken off the queue but not yet received goes back
            if g.triggered:
                self.queue.items.insert(0, g.value)
            else:
                g.cancel()

    def evacuate(self) -> tuple[list[Request], int]:
        """(requests it held, prompt tokens whose prefill work was lost); the router stops using it."""
        self.known_down = True
        lost = [r for r in self.current if isinstance(r, Request)] + self.queue.items
        wasted, self.wasted = self.wasted, 0
        self.current, self.queue.items[:], self.progress, self.queued_tokens = [], [], {}, 0
        return lost, wasted

    def restore(self) -> None:
        self.up, self.known_down = True, False
        self.current, self.progress, self._get = [], {}, None
        self.proc = self.env.process(self.run())


class DecodeInstance:
    """Continuous batching over the running set, one cost-model step per iteration. The
    running set is held as arrays (requests, generated, output and prompt lengths) so that a
    step over 30,720 sequences (EP320 at 96 per die) is a few array operations; a Request's
    `generated` is written back when it finishes or leaves the instance. A failure (`fail`)
    stops it at once: the step in flight emits nothing, and every request it holds (running or
    waiting) leaves with `evacuate` to be prefilled again, prompt and output so far."""

    def __init__(self, env: simpy.Environment, name: str, step_time: Callable[[int, float], float],
                 max_batch: int, mtp_drafts: int, mtp_acceptance: float, rng: np.random.Generator,
                 on_done: Callable[[Request], None]):
        self.env, self.name, self.step_time, self.max_batch = env, name, step_time, max_batch
        self.mtp_drafts, self.mtp_acceptance, self.rng, self.on_done = mtp_drafts, mtp_acceptance, rng, on_done
        self.waiting: list[Request] = []
        self.running = np.empty(0, dtype=object)
        self._gen = self._out = self._prompt = np.empty(0, dtype=np.int64)
        self.wakeup = env.event()
        self.steps = 0
        self.tokens_emitted = 0
        self.up, self.known_down = True, False
        self.proc = env.process(self.run())

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, req: Request) -> None:
        self.waiting.append(req)
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def tokens_this_step(self, n: int) -> np.ndarray | int:
        """Per sequence: 1 verified token plus the drafts accepted in a row (each with probability a)."""
        if not self.mtp_drafts:
            return 1
        accepted = self.rng.random((n, self.mtp_drafts)) < self.mtp_acceptance
        return 1 + np.cumprod(accepted, axis=1).sum(axis=1)

    def _admit(self) -> None:
        k = min(len(self.waiting), self.max_batch - len(self.running))
        if k <= 0:
            return
        new, self.waiting = self.waiting[:k], self.waiting[k:]
        reqs = np.empty(k, dtype=object)
        reqs[:] = new
        self.running = np.concatenate([self.running, reqs])
        self._gen = np.concatenate([self._gen, np.fromiter((r.generated for r in new), np.int64, k)])
        self._out = np.concatenate([self._out, np.fromiter((r.output_len for r in new), np.int64, k)])
        self._prompt = np.concatenate([self._prompt, np.fromiter((r.prompt_len for r in new), np.int64, k)])

    def run(self):
        try:
            yield from self._steps()
        except simpy.Interrupt:
            return

    def _steps(self):
        while True:
            self._admit()
            n = len(self.running)
            if not n:
                self.wakeup = self.env.event()
                yield self.wakeup
                continue
            mean_kv = int(self._prompt.sum() + self._gen.sum()) / n
            yield self.env.timeout(self.step_time(n, mean_kv))
            self.steps += 1
            gen = np.minimum(self._out, self._gen + self.tokens_this_step(n))
            self.tokens_emitted += int((gen - self._gen).sum())
            self._gen = gen
            done = gen >= self._out
            if done.any():
                for r in self.running[done]:
                    r.generated = r.output_len
                    r.done = self.env.now
                    self.on_done(r)
                keep = ~done
                self.running, self._gen = self.running[keep], self._gen[keep]
                self._out, self._prompt = self._out[keep], self._prompt[keep]

    def fail(self) -> None:
        if self.up:
            self.proc.interrupt()
        self.up = False

    def evacuate(self) -> tuple[list[Request], int]:
        """(requests it held, their context tokens: the KV lost with it); the router stops using it."""
        self.known_down = True
        for r, g in zip(self.running, self._gen):
            r.generated = int(g)
        lost = list(self.running) + self.waiting
        self.waiting, self.running = [], self.running[:0]
        self._gen, self._out, self._prompt = self._gen[:0], self._out[:0], self._prompt[:0]
        return lost, sum(r.prompt_len + r.generated for r in lost)

    def restore(self) -> None:
        self.up, self.known_down = True, False
        self.proc = self.env.process(self.run())


@dataclass(frozen=True)
class ServingConfig:
    prefill_instances: int = 6
    decode_instances: int = 1
    prefill_devices: int = 32  # per instance
    decode_devices: int = 320  # per instance
    max_batch_per_device: int = 96
    prefill_token_budget: int = 16384 * 32  # per prefill batch of one instance
    prefill_max_requests: int = 1024
    ems_capacity_tokens: int = 0  # 0 = no context cache
    prefill_chunk_tokens: int = 0  # per prefill step of one instance; 0 = whole prompts (no chunking)
    ems_servers: int = 1  # MP servers the context cache is sharded over (each holds capacity / servers)
    kv_transfer_gb_s: float = 25.0  # prefill -> decode hand-off per request (RDMA plane, one die)
    mtp_drafts: int = 1
    mtp_acceptance: float = 0.7
    sample_dt: float = 1.0  # utilisation sampling period, seconds
    seed: int = 0


@dataclass
class ServingResult:
    requests: list[Request]
    duration_s: float
    output_tokens: int
    devices: int
    utilisation: list[dict] = field(default_factory=list)  # time series
    ems_hit_rate: float = 0.0

    def finished(self) -> list[Request]:
        return [r for r in self.requests if r.done is not None]

    def summary(self) -> dict:
        done = self.finished()
        ttft = sorted(r.ttft for r in done)
        tpot = sorted(t for r in done if (t := r.tpot) is not None)

        def pct(xs, q):
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        return {"finished": len(done), "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"),
                "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
                "tpot_mean_ms": 1e3 * sum(tpot) / len(tpot) if tpot else float("nan"),
                "tpot_p50_ms": 1e3 * pct(tpot, 0.5), "tpot_p99_ms": 1e3 * pct(tpot, 0.99),
                "output_tokens_per_s": self.output_tokens / self.duration_s if self.duration_s else 0.0,
                "output_tokens_per_s_per_device": self.output_tokens / self.duration_s / self.devices
                if self.duration_s else 0.0,
                "ems_hit_rate": self.ems_hit_rate}


@dataclass
class Cluster:
    """The running system as a fault process sees it (`faults.FaultInjector.start`)."""

    env: simpy.Environment
    prefills: list[PrefillInstance]
    decodes: list[DecodeInstance]
    ems: EMSPool | None
    resubmit: Callable[[list[Request]], None]  # requests a failed instance held: prefilled again
    restored: Callable[[], None]  # an instance is back: requests waiting for one are routed


def simulate(requests: list[Request], cfg: ServingConfig,
             prefill_time: Callable[[list[Request]], float],
             decode_time: Callable[[int, float], float],
             kv_bytes_per_token: float = 0.0, progress: Callable[[int], None] | None = None,
             faults=None, horizon_s: float = 0.0) -> ServingResult:
    """Run the PDC system until every request has finished (or left after prefill if it
    asks for one token only), and at least until `horizon_s`. Least-loaded routing at both
    stages, over the instances not known to be down; with none, a request waits for one.
    `faults` (a faults.FaultInjector) fails and restores instances and EMS servers."""
    env = simpy.Environment()
    rng = np.random.default_rng(cfg.seed)
    ems = EMSPool(cfg.ems_capacity_tokens, cfg.ems_servers) if cfg.ems_capacity_tokens else None
    finished = [0]
    decodes: list[DecodeInstance] = []
    pending_prefill: list[Request] = []
    pending_decode: list[Request] = []

    def request_done(r: Request) -> None:
        finished[0] += 1
        if progress:
            progress(1)

    def route(r: Request, pool: list, load, pending: list[Request]) -> None:
        """To the least-loaded instance of pool not known to be down; none: held in pending."""
        live = [i for i in pool if not i.known_down]
        if live:
            min(live, key=load).submit(r)
        else:
            pending.append(r)

    def to_prefill(r: Request) -> None:
        route(r, prefills, lambda p: p.queued_tokens, pending_prefill)

    def to_decode(r: Request) -> None:
        route(r, decodes, lambda d: d.load, pending_decode)

    def handoff(r: Request):
        if kv_bytes_per_token:
            yield env.timeout(r.prefill_len * kv_bytes_per_token / (cfg.kv_transfer_gb_s * 1e9))
        to_decode(r)

    def after_prefill(r: Request) -> None:
        r.generated = r.resumed + 1
        if r.generated >= r.output_len or not decodes:
            r.done = env.now
            request_done(r)
        else:
            env.process(handoff(r))

    def resubmit(lost: list[Request]) -> None:
        for r in lost:
            r.resumed = r.generated
            to_prefill(r)

    def restored() -> None:
        for pending, route in ((pending_prefill, to_prefill), (pending_decode, to_decode)):
            waiting, pending[:] = pending[:], []
            for r in waiting:
                route(r)

    prefills = [PrefillInstance(env, f"prefill{i}", prefill_time, ems, after_prefill,
                                cfg.prefill_token_budget, cfg.prefill_max_requests, cfg.prefill_chunk_tokens)
                for i in range(cfg.prefill_instances)]
    decodes.extend(DecodeInstance(env, f"decode{i}", decode_time, cfg.max_batch_per_device * cfg.decode_devices,
                                  cfg.mtp_drafts, cfg.mtp_acceptance, rng, request_done)
                   for i in range(cfg.decode_instances))
    series: list[dict] = []

    def over() -> bool:
        return finished[0] >= len(requests) and env.now >= horizon_s

    def arrivals():
        for r in requests:
            yield env.timeout(max(0.0, r.arrival - env.now))
            to_prefill(r)

    def monitor():
        while not over():
            series.append({"t": env.now,
                           "prefill_busy": sum(p.busy for p in prefills) / len(prefills),
                           "decode_batch_fill": sum(len(d.running) for d in decodes)
                           / max(1, sum(d.max_batch for d in decodes)),
                           "prefill_queue_tokens": sum(p.queued_tokens for p in prefills),
                           "output_tokens": sum(i.tokens_emitted for i in prefills + decodes),
                           "prefill_up": sum(p.up for p in prefills) / len(prefills),
                           "decode_up": sum(d.up for d in decodes) / max(1, len(decodes))})
            yield env.timeout(cfg.sample_dt)

    env.process(arrivals())
    env.process(monitor())
    if faults is not None:
        faults.start(Cluster(env, prefills, decodes, ems, resubmit, restored))
    while not over():
        if not env.peek() < math.inf:
            if finished[0] < len(requests):
                raise RuntimeError("simulation stalled with unfinished requests")
            break
        env.step()
    if faults is not None:
        faults.close(env.now)
    out_tokens = sum(r.output_len for r in requests if r.done is not None)
    devices = cfg.prefill_instances * cfg.prefill_devices + cfg.decode_instances * cfg.decode_devices
    start = min((r.arrival for r in requests), default=0.0)
    hit = ems.hits / ems.lookups if ems and ems.lookups else 0.0
    return ServingResult(requests, env.now - start, out_tokens, devices, series, hit)


class CostModelTimes:
    """Step-time functions for `simulate` from the cost model (memoised on rounded inputs)."""

    def __init__(self, hw: HardwareSpec, model: ModelSpec, cfg: ServingConfig, prefill_overrides: dict | None = None,
                 decode_overrides: dict | None = None):
        self.hw, self.model, self.cfg = hw, model, cfg
        self.prefill_overrides = prefill_overrides or {}
        self.decode_overrides = decode_overrides or {}
        self.page_gb_s = page_read_gb_s(hw, "ub", cfg.prefill_instances * cfg.prefill_devices)

    @lru_cache(maxsize=65536)
    def _prefill(self, tokens_per_device: int, eq_len: int, hit_pct: int, in_hbm_pct: int = 0) -> float:
        pc = PrefillConfig(tokens_per_device=tokens_per_device, prompt_len=eq_len, devices=self.cfg.prefill_devices,
                           ep=self.cfg.prefill_devices, cache_hit=(hit_pct + in_hbm_pct) / 100,
                           prefix_in_hbm=in_hbm_pct > 0 and hit_pct == 0, **self.prefill_overrides)
        return prefill_batch(self.hw, self.model, pc).ttft_s

    def prefill_time(self, batch: list) -> float:
        """Requests, or Chunks of them: a chunk after `prefix_done` tokens is costed as a prompt of
        done + chunk tokens whose first `done` are a prefix already in HBM."""
        done = [getattr(r, "prefix_done", 0) for r in batch]
        lens = [r.prefill_len + d for r, d in zip(batch, done)]
        tokens = sum(lens)
        cached = sum(r.cached_tokens for r in batch)
        sq = sum(n**2 for n in lens)
        eq_len = max(1, round(sq / tokens / 64) * 64)  # token-weighted mean length: same attention work
        per_dev = max(1, round(tokens / self.cfg.prefill_devices / 64) * 64)
        return self._prefill(per_dev, eq_len, min(99, round(100 * cached / tokens)),
                             min(99 - min(99, round(100 * cached / tokens)), round(100 * sum(done) / tokens)))

    @lru_cache(maxsize=65536)
    def _decode(self, batch_per_device: int, kv: int) -> float:
        dc = DecodeConfig(batch_per_device=batch_per_device, kv_len=kv, ep=self.cfg.decode_devices,
                          mtp_drafts=self.cfg.mtp_drafts, mtp_acceptance=self.cfg.mtp_acceptance,
                          **self.decode_overrides)
        return decode_step(self.hw, self.model, dc).step_ms / 1e3

    def decode_time(self, running: int, mean_kv: float) -> float:
        return self._decode(math.ceil(running / self.cfg.decode_devices), max(64, round(mean_kv / 64) * 64))

    def kv_bytes_per_token(self) -> float:
        return self.model.layers * self.model.kv_elems_per_token_layer() * BYTES["bf16"]
