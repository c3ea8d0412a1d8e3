"""A whole EMS pool on this machine as real processes: controller + N MP servers.

Used by the tests and the benchmark; also handy for trying EMS out:

    with LocalCluster(n_servers=2, root="/tmp/ems") as cl:
        c = EMSClient(cl.controller, "tenant-a")
"""

from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from matrixinfer.lifetime import die_with_parent

from .protocol import call_once


@dataclass
class Proc:
    argv: list[str]
    popen: subprocess.Popen
    addr: str
    id: str | None = None


@dataclass
class LocalCluster:
    n_servers: int = 2
    root: str = "/tmp/ems-local"
    dram_bytes: int = 64 << 20
    fsync: str = "always"
    heartbeat_timeout_s: float = 1.5
    heartbeat_s: float = 0.2
    huge_pages: str = "auto"
    servers: list[Proc] = field(default_factory=list)
    ctl: Proc | None = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # unique server ids per pool

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def controller(self) -> str:
        return self.ctl.addr

    def _spawn(self, args: list[str], log: str, **popen_kwargs) -> Proc:
        argv = [sys.executable, "-m", "matrixinfer.ems", *args]
        err = open(os.path.join(self.root, log), "ab")
        # its own session: a terminal's Ctrl-C or a group SIGTERM reaches the owner, which stops
        # the pool in order; the kernel sends SIGTERM if the owner dies first
        popen_kwargs = {"start_new_session": True, "preexec_fn": die_with_parent, **popen_kwargs}
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, **popen_kwargs)
        err.close()
        deadline = time.monotonic() + 30
        line = b""
        while not line.endswith(b"\n"):
            if time.monotonic() > deadline or p.poll() is not None:
                p.kill()
                raise RuntimeError(f"{' '.join(args[:1])} did not start; see {os.path.join(self.root, log)}")
            if select.select([p.stdout], [], [], 0.1)[0]:
                line += os.read(p.stdout.fileno(), 1)
        fields = line.decode().split()  # "READY host:port [id=...]"
        proc = Proc(argv, p, fields[1])
        for f in fields[2:]:
            if f.startswith("id="):
                proc.id = f[3:]
        return proc

    def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self.start_controller()
        for _ in range(self.n_servers):
            self.add_server(wait=False)
        self.wait_members(self.n_servers)

    def start_controller(self, port: int = 0) -> None:
        """Its state is kept in root/controller.db: a restart (same port) restores it."""
        self.ctl = self._spawn(["controller", "--port", str(port), "--heartbeat-timeout", str(self.heartbeat_timeout_s),
                                "--db", os.path.join(self.root, "controller.db")], "controller.log")

    def restart_controller(self, sig: int = signal.SIGKILL) -> None:
        """Kill the controller and start it again on the same address (servers re-find it)."""
        self.ctl.popen.send_signal(sig)
        self.ctl.popen.wait(10)
        self.ctl.popen.stdout.close()
        self.start_controller(int(self.controller.rsplit(":", 1)[1]))

    def server_args(self, i: int) -> list[str]:
        return ["server", "--controller", self.controller, "--ssd-dir", os.path.join(self.root, f"mp{i}"),
                "--dram-bytes", str(self.dram_bytes), "--fsync", self.fsync, "--heartbeat", str(self.heartbeat_s), "--id", f"mp{i}-{self.tag}",
                "--huge-pages", self.huge_pages]

    def add_server(self, wait: bool = True) -> int:
        i = len(self.servers)
        self.servers.append(self._spawn(self.server_args(i), f"mp{i}.log"))
        if wait:
            self.wait_members(len(self.alive()))
        return i

    def alive(self) -> list[int]:
        return [i for i, s in enumerate(self.servers) if s.popen.poll() is None]

    def members(self) -> list[str]:
        return [m["id"] for m in call_once(self.controller, {"op": "view"})["servers"]]

    def wait_members(self, n: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.members()) != n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected {n} servers in the view, have {self.members()}")
            time.sleep(0.05)

    def wait_repaired(self, n: int, timeout_s: float = 20.0) -> dict[str, dict]:
        """Until the view has n servers and each has finished re-replicating for that view
        (repair.py); their stats."""
        self.wait_members(n, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            view = call_once(self.controller, {"op": "view"})
            try:
                st = {m["id"]: call_once(f"{m['host']}:{m['port']}", {"op": "stats"}) for m in view["servers"]}
            except OSError:
                st = {}  # a server left meanwhile: look again
            if len(st) == n and all(s["repair"]["version"] >= view["version"] for s in st.values()):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"re-replication not finished: { {i: s['repair'] for i, s in st.items()} }")
            time.sleep(0.05)

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.servers[i].popen
        p.send_signal(sig)
        p.wait(10)

    def restart_server(self, i: int) -> None:
        """Same id and SSD dir: it takes back its ring slot and recovers its log."""
        self.servers[i] = proc = self._spawn(self.server_args(i), f"mp{i}.log")
        deadline = time.monotonic() + 20
        while True:  # the view may still list the dead incarnation: wait for the new address
            view = {m["id"]: f"{m['host']}:{m['port']}" for m in call_once(self.controller, {"op": "view"})["servers"]}
            if view.get(proc.id) == proc.addr:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"restarted server {proc.id} not in the view")
            time.sleep(0.05)

    def close(self) -> None:
        procs = [*self.servers, *([self.ctl] if self.ctl else [])]
        for p in procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        for p in procs:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                p.popen.send_signal(signal.SIGKILL)
                p.popen.wait(5)
            if p.popen.stdout:
                p.popen.stdout.close()
        for s in self.servers:  # arenas of killed servers are left in /dev/shm
            for path in glob.glob(f"/dev/shm/mi-ems-{s.id}-*"):
                os.unlink(path)
