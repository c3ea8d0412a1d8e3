"""Hardware as data: one YAML file per system, loaded into typed dataclasses and validated.

A *device* is the unit the software sees and the unit throughput is normalised to: one die
of an Ascend 910C (CANN exposes each die as its own NPU), one GPU of an H800 node. Every
bandwidth and FLOP number in the YAML is per device unless its name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

HARDWARE_DIR = Path(__file__).parent / "hardware"


class SpecError(ValueError):
    """A hardware or model file is missing a field or has an impossible value."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    per_package: int  # devices per physical chip package (2 dies per 910C)
    tflops: dict[str, float]  # dense peak per precision: bf16, int8, fp8 ...
    hbm_gb: float
    hbm_tb_s: float
    cube_cores: int = 0
    vector_cores: int = 0


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak. Measured values are inputs; `overlap` is the fitted one."""

    mla_compute: float  # attention core, compute-bound
    mla_memory: float  # any memory-bound operator, fraction of HBM bandwidth
    gemm: dict[str, float]  # GEMM efficiency per precision
    link: float  # goodput fraction of a network plane's line rate
    overlap: float  # fraction of the shorter microbatch path hidden behind the longer one


@dataclass(frozen=True)
class PlaneSpec:
    """One network plane as seen from one device (bandwidth each way)."""

    name: str
    gb_s: float  # per device, each direction
    latency_us: float  # one-way, end to end
    per_peer_us: float  # signalling cost per distinct peer in an all-to-all
    domain: int  # devices reachable on this plane (0 = unbounded)


@dataclass(frozen=True)
class ClosSpec:
    """Two-tier Clos of the scale-up plane (CloudMatrix UB)."""

    devices_per_node: int
    l1_per_node: int
    l1_down_ports: int
    l1_up_ports: int
    l2_subplanes: int
    l2_per_subplane: int
    l2_ports: int
    port_gb_s: float


@dataclass(frozen=True)
class CollectiveSpec:
    """Fixed costs of a fused dispatch / combine kernel beyond moving its payload.

    launch_us: kernel launch and the final barrier, paid once per kernel.
    handshake_us: one synchronisation round inside the kernel (flag write to the peers, the
    peers' vector cores polling the flag in HBM and seeing it), beyond the plane's one-way
    latency. Dispatch pays two rounds (metadata exchange, then data), combine one.
    """

    launch_us: float = 0.0
    handshake_us: float = 0.0
    metadata_rounds: float = 1.0  # 0 where counts travel with the data (DeepEP low-latency)


@dataclass(frozen=True)
class CollectiveCalibration:
    """Measured dispatch / combine latencies the CollectiveSpec is fitted to."""

    tokens: int
    ep: int
    dispatch_precision: str
    combine_precision: str
    dispatch_us: float
    combine_us: float


@dataclass(frozen=True)
class HostSpec:
    """Host-side cost of one engine step (the local machine's engine runs eagerly)."""

    step_overhead_us: float = 0.0  # scheduler, input preparation, sampling: per step
    per_seq_us: float = 0.0  # per running sequence per step
    op_launch_us: float = 0.0  # dispatch cost of one operator launch
    # an eager engine's prefill operators (per-sequence attention, padded expert groups) over
    # their rooflines; 1 for a graph-mode instance
    prefill_factor: float = 1.0


SOURCE_KINDS = ("hardware fact", "paper measurement", "fitted", "assumption", "measured on")


@dataclass(frozen=True)
class Calibration:
    """The one measured decode point the overlap efficiency is fitted to."""

    kv_len: int
    batch_per_device: int
    ep: int
    tpot_ms: float
    tokens_per_s_per_npu: float


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    device: DeviceSpec
    devices: int  # in one supernode / cluster
    devices_per_node: int
    efficiency: Efficiency
    scale_up: PlaneSpec  # UB on CloudMatrix, NVLink on GPU nodes
    scale_out: PlaneSpec  # RDMA
    vpc_node_gb_s: float  # VPC plane per node
    ep_decode_plane: str  # plane of the low-latency expert all-to-all: "scale_up" or "scale_out"
    cpu_sockets: int = 0
    cpu_mem_gb_s: float = 0.0  # per CPU socket, what an EMS server can serve
    clos: ClosSpec | None = None
    calibration: Calibration | None = None
    collective: CollectiveSpec = CollectiveSpec()
    collective_calibration: CollectiveCalibration | None = None
    host: HostSpec = HostSpec()
    sources: dict = field(default_factory=dict)  # dotted field -> where its value comes from
    extra: dict = field(default_factory=dict)

    def plane(self, which: str) -> PlaneSpec:
        return {"scale_up": self.scale_up, "scale_out": self.scale_out}[which]

    def peak_flops(self, precision: str) -> float:
        if precision not in self.device.tflops:
            raise SpecError(f"{self.name}: {self.device.name} has no {precision} support (has {sorted(self.device.tflops)})")
        return self.device.tflops[precision] * 1e12

    def gemm_efficiency(self, precision: str) -> float:
        return self.efficiency.gemm.get(precision, self.efficiency.gemm.get("default", 0.8))


def _need(d: dict, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise SpecError(f"{where}: missing field '{key}'")
    return d[key]


def _positive(d: dict, key: str, where: str, kind=float):
    v = _need(d, key, where)
    try:
        v = kind(v)
    except (TypeError, ValueError):
        raise SpecError(f"{where}.{key}: expected a number, got {v!r}") from None
    if v <= 0:
        raise SpecError(f"{where}.{key}: must be > 0, got {v}")
    return v


def _fraction(d: dict, key: str, where: str) -> float:
    v = _positive(d, key, where)
    if v > 1:
        raise SpecError(f"{where}.{key}: an efficiency must be in (0, 1], got {v}")
    return v


def _plane(d: dict, where: str) -> PlaneSpec:
    return PlaneSpec(
        name=str(_need(d, "name", where)),
        gb_s=_positive(d, "gb_s", where),
        latency_us=_positive(d, "latency_us", where),
        per_peer_us=float(d.get("per_peer_us", 0.0)),
        domain=int(d.get("domain", 0)),
    )


def numeric_fields(raw: dict, prefix: str = "") -> list[str]:
    """Dotted names of every number in a hardware file (the constants that need a source)."""
    out = []
    for k, v in raw.items():
        name = f"{prefix}{k}"
        if k == "sources":
            continue
        if isinstance(v, dict):
            out += numeric_fields(v, name + ".")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(name)
    return out


def _sources(raw: dict, where: str) -> dict:
    """`sources:` maps a dotted field to where its value comes from; each must name a field
    of the file and start with one of SOURCE_KINDS."""
    src = raw.get("sources", {}) or {}
    if not isinstance(src, dict):
        raise SpecError(f"{where}.sources: expected a mapping field -> source")
    known = set(numeric_fields(raw))
    for k, v in src.items():
        if k not in known:
            raise SpecError(f"{where}.sources: '{k}' is not a numeric field of this file")
        if not str(v).startswith(SOURCE_KINDS):
            raise SpecError(f"{where}.sources.{k}: must start with one of {SOURCE_KINDS}, got {v!r}")
    return {str(k): str(v) for k, v in src.items()}


def _optional_floats(raw: dict, key: str, cls, where: str):
    d = raw.get(key)
    if d is None:
        return cls()
    vals = {}
    for k in cls.__dataclass_fields__:
        v = float(d.get(k, cls.__dataclass_fields__[k].default))
        if v < 0:
            raise SpecError(f"{where}.{key}.{k}: must be >= 0, got {v}")
        vals[k] = v
    return cls(**vals)


def _collective_calibration(raw: dict, where: str) -> CollectiveCalibration | None:
    c = raw.get("collective_calibration")
    if c is None:
        return None
    w = f"{where}.collective_calibration"
    return CollectiveCalibration(
        tokens=_positive(c, "tokens", w, int), ep=_positive(c, "ep", w, int),
        dispatch_precision=str(_need(c, "dispatch_precision", w)),
        combine_precision=str(_need(c, "combine_precision", w)),
        dispatch_us=_positive(c, "dispatch_us", w), combine_us=_positive(c, "combine_us", w))


def hardware_from_dict(raw: dict, source: str = "<dict>") -> HardwareSpec:
    w = source
    dev = _need(raw, "device", w)
    tflops = _need(dev, "tflops", f"{w}.device")
    if not isinstance(tflops, dict) or not tflops:
        raise SpecError(f"{w}.device.tflops: expected a mapping precision -> TFLOPS")
    for p in tflops:
        _positive(tflops, p, f"{w}.device.tflops")
    device = DeviceSpec(
        name=str(_need(dev, "name", f"{w}.device")),
        per_package=_positive(dev, "per_package", f"{w}.device", int),
        tflops={k: float(v) for k, v in tflops.items()},
        hbm_gb=_positive(dev, "hbm_gb", f"{w}.device"),
        hbm_tb_s=_positive(dev, "hbm_tb_s", f"{w}.device"),
        cube_cores=int(dev.get("cube_cores", 0)),
        vector_cores=int(dev.get("vector_cores", 0)),
    )
    eff = _need(raw, "efficiency", w)
    gemm = _need(eff, "gemm", f"{w}.efficiency")
    for p in gemm:
        _fraction(gemm, p, f"{w}.efficiency.gemm")
    efficiency = Efficiency(
        mla_compute=_fraction(eff, "mla_compute", f"{w}.efficiency"),
        mla_memory=_fraction(eff, "mla_memory", f"{w}.efficiency"),
        gemm={k: float(v) for k, v in gemm.items()},
        link=_fraction(eff, "link", f"{w}.efficiency"),
        overlap=_fraction(eff, "overlap", f"{w}.efficiency"),
    )
    planes = _need(raw, "planes", w)
    clos = None
    if "clos" in raw:
        c = raw["clos"]
        clos = ClosSpec(**{k: _positive(c, k, f"{w}.clos", float if k == "port_gb_s" else int)
                           for k in ClosSpec.__dataclass_fields__})
    calibration = None
    if "calibration" in raw:
        c = raw["calibration"]
        calibration = Calibration(
            kv_len=_positive(c, "kv_len", f"{w}.calibration", int),
            batch_per_device=_positive(c, "batch_per_device", f"{w}.calibration", int),
            ep=_positive(c, "ep", f"{w}.calibration", int),
            tpot_ms=_positive(c, "tpot_ms", f"{w}.calibration"),
            tokens_per_s_per_npu=_positive(c, "tokens_per_s_per_npu", f"{w}.calibration"),
        )
    ep_plane = str(raw.get("ep_decode_plane", "scale_up"))
    if ep_plane not in ("scale_up", "scale_out"):
        raise SpecError(f"{w}.ep_decode_plane: must be scale_up or scale_out, got {ep_plane!r}")
    return HardwareSpec(
        name=str(_need(raw, "name", w)),
        device=device,
        devices=_positive(raw, "devices", w, int),
        devices_per_node=_positive(raw, "devices_per_node", w, int),
        efficiency=efficiency,
        scale_up=_plane(_need(planes, "scale_up", f"{w}.planes"), f"{w}.planes.scale_up"),
        scale_out=_plane(_need(planes, "scale_out", f"{w}.planes"), f"{w}.planes.scale_out"),
        vpc_node_gb_s=_positive(planes, "vpc_node_gb_s", f"{w}.planes"),
        ep_decode_plane=ep_plane,
        cpu_sockets=int(raw.get("cpu_sockets", 0)),
        cpu_mem_gb_s=float(raw.get("cpu_mem_gb_s", 0.0)),
        clos=clos,
        calibration=calibration,
        collective=_optional_floats(raw, "collective", CollectiveSpec, w),
        collective_calibration=_collective_calibration(raw, w),
        host=_optional_floats(raw, "host", HostSpec, w),
        sources=_sources(raw, w),
        extra=dict(raw.get("extra", {})),
    )


def available_hardware() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    """Load a bundled system by name (e.g. 'cloudmatrix384') or any YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise SpecError(f"no hardware file {path} (bundled: {', '.join(available_hardware())})")
    raw = yaml.safe_load(path.read_text())
    return hardware_from_dict(raw, source=path.name)
