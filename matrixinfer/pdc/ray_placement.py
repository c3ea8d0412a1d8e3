"""Placing the P/D/C roles on a Ray cluster (`matrixinfer serve --ray-address auto|HOST:PORT`),
which is how a deployment grows past one machine.

Each prefill or decode instance is a Ray actor that runs the same engine core loop as a local
core process (`engine/core_client._core_main`); instead of a pipe it connects back to the front
end over TCP (a multiprocessing Connection with a per-instance auth key), so the front end,
the hand-off and the failure handling do not change. EMS processes (controller, MP servers)
are started by actors on the nodes Ray picks; they bind the node's address. Actors are spread
over nodes. Model directories must exist at the same path on every node (or use
`--load-format ems`, which reads them once through the pool).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Client, Listener

import ray

from matrixinfer.config import EngineConfig
from matrixinfer.engine.core_client import RemoteCoreClient, _core_main


@ray.remote(num_cpus=0, max_restarts=0)
class CoreActor:
    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, config: EngineConfig, address, authkey: bytes, title: str) -> None:
        _core_main(config, Client(address, authkey=authkey), title)


@ray.remote(num_cpus=0, max_restarts=0)
class EMSProcessActor:
    """One EMS process (controller or MP server) on this actor's node."""

    def start(self, args: list[str]) -> str:
        from matrixinfer.ems.local import LocalCluster

        self.root = tempfile.mkdtemp(prefix="matrixinfer-ems-ray-")
        host = ray.util.get_node_ip_address()
        cluster = LocalCluster(root=self.root)
        kind = args[0]
        args = [a.replace("{root}", self.root) for a in args] + ["--host", host]
        self.proc = cluster._spawn(args, f"{kind}.log")  # it goes when this actor goes
        return self.proc.addr

    def stop(self) -> None:
        self.proc.popen.terminate()
        try:
            self.proc.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.popen.kill()


def connect(address: str) -> None:
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ":".join(sys.path)}})


class RayCoreClient(RemoteCoreClient):
    """An engine core in a Ray actor, connected back to this front end over TCP."""

    def __init__(self, config: EngineConfig, title: str, start_timeout_s: float = 300.0):
        started = time.monotonic()
        authkey = secrets.token_bytes(16)
        listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        self.actor = CoreActor.options(name=None, scheduling_strategy="SPREAD").remote()
        self._run = self.actor.run.remote(config, listener.address, authkey, title)
        accepted: list = []
        t = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        t.start()
        t.join(start_timeout_s)
        listener.close()
        if not accepted:
            ray.kill(self.actor)
            raise RuntimeError(f"the engine core actor {title} did not connect back in {start_timeout_s} s")
        self._finalizer = weakref.finalize(self, _stop_actor, self.actor, accepted[0])
        self._handshake(accepted[0], [], start_timeout_s, started)

    def kill(self) -> None:
        ray.kill(self.actor)


def _stop_actor(actor, conn) -> None:
    try:
        conn.send(None)
    except OSError:
        pass
    try:
        ray.get(actor.pid.remote(), timeout=0.1)  # still there: give it a moment to return from run()
        time.sleep(1)
    except Exception:
        pass
    ray.kill(actor)
    conn.close()


class RayEMSCluster:
    """An EMS controller and MP servers started by actors on Ray's nodes."""

    def __init__(self, n_servers: int, dram_mb: int = 256):
        self.actors = []
        ctl = EMSProcessActor.remote()
        self.actors.append(ctl)
        self.controller = ray.get(ctl.start.remote(["controller", "--port", "0", "--db", "{root}/controller.db"]))
        for i in range(n_servers):
            a = EMSProcessActor.options(scheduling_strategy="SPREAD").remote()
            self.actors.append(a)
            ray.get(a.start.remote(["server", "--controller", self.controller, "--ssd-dir", "{root}/mp",
                                    "--dram-bytes", str(dram_mb << 20)]))

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=20)
            except Exception:
                pass
            ray.kill(a)
