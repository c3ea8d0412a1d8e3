"""Typed configs of the EMS roles (controller, MP server, client)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ControllerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    heartbeat_timeout_s: float = 3.0  # a server silent this long is dropped from the ring
    vnodes: int = 160  # virtual nodes per server on the hash ring
    db: str | None = None  # SQLite file of namespaces, quotas and members (None: not persisted)
    shm_dir: str = "/dev/shm"  # where dead MP servers' arenas are reaped at start


@dataclass
class ServerConfig:
    controller: str = "127.0.0.1:7900"
    host: str = "127.0.0.1"
    port: int = 0
    dram_bytes: int = 256 << 20
    ssd_dir: str = "ems-ssd"
    server_id: str | None = None  # default: derived from ssd_dir, so a restart keeps its ring slot
    fsync: str = "always"  # always: ack after fsync (group commit); never: ack after write()
    segment_bytes: int = 64 << 20
    heartbeat_s: float = 0.5
    shm_dir: str = "/dev/shm"
    huge_pages: str = "auto"  # auto | on | off: the arena on huge pages where the machine allows
    numa_node: str = "auto"  # auto (this CPU's node if there are several) | off | a node number
    drain_timeout_s: float = 10.0  # on SIGTERM: how long requests in flight may take to finish


@dataclass
class ClientConfig:
    controller: str = "127.0.0.1:7900"
    namespace: str = "default"
    timeout_s: float = 5.0  # per request; a server that does not answer in time is a miss
    zero_copy: bool = True  # read through the server's shared-memory arena when on the same host
    view_refresh_s: float = 1.0
    down_backoff_s: float = 1.0  # after a connection failure, skip that server this long
