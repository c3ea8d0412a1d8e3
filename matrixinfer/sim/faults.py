"""Failures of a PDC deployment: the fault schedule, what a fault takes down, and the process
that fails and restores instances and EMS servers in the serving simulation (serving.py).

Components, numbered over the devices the deployment uses (prefill instances first, then
decode instances, in device order):
  npu   one accelerator package (a 910C holds 2 devices, an H800 1)
  link  one device's port into the network (CloudMatrix: its 7 UB links, one per L1 switch
        chip of its node; a GPU: its RDMA NIC)
  node  a server: `devices_per_node` devices and the EMS MP servers running on its CPUs
  ems   one EMS MP server
What a fault takes down: an npu, link or node fault takes every instance with a device on it,
whole (an EP group cannot run with a member missing: every MoE layer is an all-to-all over
all of them); an EMS server fault loses its cache shard. A fault is detected after
`detect_s`; then the instance's requests are prefilled again elsewhere, prompt plus the
output so far, and it is rebuilt, back `recover_s` later. A fault on an instance already
down is absorbed (its devices are being replaced), as the alternating-renewal closed form
`availability` assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import yaml

from matrixinfer.sim.capacity import weight_bytes_per_device
from matrixinfer.sim.hardware import HardwareSpec
from matrixinfer.sim.modelspec import ModelSpec
from matrixinfer.sim.prefill import page_read_gb_s
from matrixinfer.sim.serving import Cluster, ServingConfig

KINDS = ("npu", "link", "node", "ems")
# Defaults and where they come from (docs/simulator.md, "Failures"):
# assumption: the Llama 3 405B report's 256 GPU, HBM3, SRAM and GPU-processor interruptions in
# 54 days on 16,384 H100s (16,384 x 1,296 h / 256); no NPU failure rate is published
NPU_MTBF_H = 83_000.0
DETECT_S = 3.0  # assumption for instances; for EMS servers the controller's heartbeat timeout (docs/ems.md)
RESTART_S = 2.6  # measured: a decode instance killed with -9 was serving again after 2.6 s (docs/pdc.md)
EMS_RECOVER_S = 30.0  # assumption: a replacement MP server process joins, its DRAM empty


@dataclass(frozen=True)
class FaultKind:
    mtbf_h: float = 0.0  # per component, exponential inter-arrival times; 0 = no random faults
    detect_s: float = DETECT_S
    recover_s: float | None = None  # None: instances RESTART_S + weight reload (instance_recover_s), EMS_RECOVER_S


@dataclass(frozen=True)
class FaultEvent:
    t: float
    component: str  # "npu:12", "link:40", "node:3", "ems:5"

    @property
    def kind(self) -> str:
        return self.component.split(":")[0]

    @property
    def index(self) -> int:
        return int(self.component.split(":")[1])


@dataclass(frozen=True)
class FaultSchedule:
    npu: FaultKind = FaultKind(NPU_MTBF_H)
    link: FaultKind = FaultKind()
    node: FaultKind = FaultKind()
    ems: FaultKind = FaultKind()
    events: tuple[FaultEvent, ...] = ()  # explicit faults, besides the random ones
    horizon_s: float = 600.0
    seed: int = 0

    def kind(self, name: str) -> FaultKind:
        return getattr(self, name)


def parse_event(text: str) -> FaultEvent:
    """'T:KIND:INDEX', e.g. '120:npu:37'."""
    try:
        t, kind, idx = text.split(":")
        ev = FaultEvent(float(t), f"{kind}:{int(idx)}")
    except ValueError:
        raise ValueError(f"fault event {text!r}: expected T:KIND:INDEX, e.g. 120:npu:37") from None
    if kind not in KINDS:
        raise ValueError(f"fault event {text!r}: kind must be one of {', '.join(KINDS)}")
    return ev


def load_schedule(path: str | Path, base: FaultSchedule = FaultSchedule()) -> FaultSchedule:
    """YAML: horizon_s, seed, and per kind {mtbf_h, detect_s, recover_s}; events: [{t, component}]."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(doc) - set(KINDS) - {"events", "horizon_s", "seed"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    kw = {}
    for k in KINDS:
        spec = doc.get(k) or {}
        bad = set(spec) - {f.name for f in fields(FaultKind)}
        if bad:
            raise ValueError(f"{path}: {k}: unknown keys {sorted(bad)}")
        kw[k] = replace(base.kind(k), **spec)
    events = tuple(parse_event(f"{e['t']}:{e['component']}") for e in doc.get("events") or ())
    return replace(base, **kw, events=base.events + events, horizon_s=float(doc.get("horizon_s", base.horizon_s)),
                   seed=int(doc.get("seed", base.seed)))


def availability(n: int, rate_per_s: float, mttr_s: float) -> float:
    """Up fraction of an instance of n components failing at `rate_per_s` each, down for
    mttr_s per failure, faults while down absorbed: up ~ Exp(n lambda), down = MTTR."""
    return 1.0 / (1.0 + n * rate_per_s * mttr_s)


@dataclass(frozen=True)
class Layout:
    """Devices of each instance and how devices group into packages, links and nodes."""

    prefill_instances: int
    prefill_devices: int
    decode_instances: int
    decode_devices: int
    per_package: int
    per_node: int
    links_per_device: int
    ems_servers: int = 0

    @classmethod
    def of(cls, hw: HardwareSpec, cfg: ServingConfig) -> Layout:
        links = hw.clos.l1_per_node if hw.clos else 1  # a UB link to each L1 chip of the node; one NIC per GPU
        return cls(cfg.prefill_instances, cfg.prefill_devices, cfg.decode_instances, cfg.decode_devices,
                   hw.device.per_package, hw.devices_per_node, links,
                   cfg.ems_servers if cfg.ems_capacity_tokens else 0)

    @property
    def devices(self) -> int:
        return self.prefill_instances * self.prefill_devices + self.decode_instances * self.decode_devices

    def components(self, kind: str) -> int:
        return {"npu": math.ceil(self.devices / self.per_package), "link": self.devices * self.links_per_device,
                "node": math.ceil(self.devices / self.per_node), "ems": self.ems_servers}[kind]

    def hit(self, kind: str, index: int) -> tuple[list[int], list[int], list[int]]:
        """(prefill instances, decode instances, EMS servers) a fault of this component takes down."""
        if not 0 <= index < self.components(kind):
            raise ValueError(f"{kind}:{index} is not in this deployment ({self.components(kind)} {kind} components)")
        if kind == "ems":
            return [], [], [index]
        lo, hi = {"npu": (index * self.per_package, (index + 1) * self.per_package),
                  "link": (index // self.links_per_device, index // self.links_per_device + 1),
                  "node": (index * self.per_node, (index + 1) * self.per_node)}[kind]
        first = self.prefill_instances * self.prefill_devices
        prefill = [i for i in range(self.prefill_instances)
                   if i * self.prefill_devices < hi and lo < (i + 1) * self.prefill_devices]
        decode = [j for j in range(self.decode_instances)
                  if first + j * self.decode_devices < hi and lo < first + (j + 1) * self.decode_devices]
        nodes = self.components("node")
        ems = [k for k in range(self.ems_servers) if kind == "node" and k % nodes == index]
        return prefill, decode, ems


def random_events(layout: Layout, schedule: FaultSchedule) -> list[FaultEvent]:
    """Exponential arrivals per component over the horizon (the superposition: a Poisson count,
    uniform times, uniform components). Each kind has its own seeded stream, so layouts with
    the same devices see the same faults of the same components at the same times."""
    out = []
    for i, k in enumerate(KINDS):
        n, mtbf = layout.components(k), schedule.kind(k).mtbf_h
        if not n or mtbf <= 0:
            continue
        rng = np.random.default_rng([schedule.seed, i])
        count = rng.poisson(n / (mtbf * 3600) * schedule.horizon_s)
        out += [FaultEvent(float(t), f"{k}:{c}")
                for t, c in zip(rng.uniform(0, schedule.horizon_s, count), rng.integers(0, n, count))]
    return sorted(out + list(schedule.events), key=lambda e: e.t)


def instance_recover_s(hw: HardwareSpec, model: ModelSpec, devices: int, weight_precision: str = "int8") -> float:
    """Rebuild of an instance of `devices` devices: the measured restart plus every device
    reading its weights from the EMS model cache at once (caching.model_cache's bandwidths)."""
    gb = weight_bytes_per_device(model, weight_precision, 1, devices) / 1e9
    return RESTART_S + gb / page_read_gb_s(hw, "ub", devices)


@dataclass
class FaultStats:
    faults: int = 0  # events applied
    absorbed: int = 0  # instance or server hits that found it already down
    instance_failures: dict = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    down_s: dict = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0, "ems": 0.0})
    recomputed_decode_tokens: int = 0  # context (prompt + output so far) of requests a decode instance lost
    recomputed_prefill_tokens: int = 0  # prefill work lost with a prefill instance
    ems_miss_tokens: int = 0  # prefix tokens prefilled again because a failed EMS server held them
    log: list = field(default_factory=list)  # (t, component, [names taken down])

    @property
    def recomputed_tokens(self) -> int:
        return self.recomputed_decode_tokens + self.recomputed_prefill_tokens + self.ems_miss_tokens


class FaultInjector:
    """Plays a fault list against a running simulation (`serving.simulate(..., faults=...)`)."""

    def __init__(self, events: list[FaultEvent], layout: Layout, schedule: FaultSchedule,
                 recover_s: dict[str, float]):
        self.events, self.layout, self.schedule = sorted(events, key=lambda e: e.t), layout, schedule
        self.recover_default = recover_s  # per role: "prefill", "decode", "ems"
        self.stats = FaultStats()
        self._since: dict[tuple[str, int], float] = {}

    def start(self, cluster: Cluster) -> None:
        self.c = cluster
        cluster.env.process(self._play())

    def _recover_s(self, kind: str, role: str) -> float:
        r = self.schedule.kind(kind).recover_s
        return self.recover_default[role] if r is None else r

    def _play(self):
        env = self.c.env
        for ev in self.events:
            yield env.timeout(max(0.0, ev.t - env.now))
            self._apply(ev)

    def _apply(self, ev: FaultEvent) -> None:
        prefill, decode, ems = self.layout.hit(ev.kind, ev.index)
        self.stats.faults += 1
        targets = [("prefill", i, self.c.prefills[i]) for i in prefill] + \
                  [("decode", j, self.c.decodes[j]) for j in decode]
        if self.c.ems:
            targets += [("ems", k, None) for k in ems]
        hit = []
        for role, i, inst in targets:
            if (role, i) in self._since:
                self.stats.absorbed += 1
                continue
            self._since[(role, i)] = self.c.env.now
            hit.append(f"{role}{i}")
            if role == "ems":
                self.c.ems.fail_server(i)
            else:
                inst.fail()
                self.stats.instance_failures[role] += 1
            self.c.env.process(self._recover(ev.kind, role, i, inst))
        self.stats.log.append((ev.t, ev.component, hit))

    def _recover(self, kind: str, role: str, i: int, inst):
        env = self.c.env
        yield env.timeout(self.schedule.kind(kind).detect_s)
        if role == "ems":
            self.c.ems.detect_server(i)
        else:
            lost, tokens = inst.evacuate()
            if role == "decode":
                self.stats.recomputed_decode_tokens += tokens
            else:
                self.stats.recomputed_prefill_tokens += tokens
            self.c.resubmit(lost)
        yield env.timeout(self._recover_s(kind, role))
        if role == "ems":
            self.c.ems.restore_server(i)
        else:
            inst.restore()
        self.stats.down_s[role] += env.now - self._since.pop((role, i))
        self.c.restored()

    def close(self, now: float) -> None:
        """Count the downtime of what is still down at the end of the run."""
        for (role, _), since in self._since.items():
            self.stats.down_s[role] += now - since
        self._since.clear()
        if self.c.ems:
            self.stats.ems_miss_tokens = self.c.ems.fault_miss_tokens
