"""Start a whole P/D/C stack on this machine: an EMS pool (controller + MP servers, real
processes), N prefill and M decode instances (each an engine core process with its workers),
and the PDC front end that serving's HTTP API talks to."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import replace

from matrixinfer.config import EngineConfig, KVTransferConfig
from matrixinfer.pdc.client import PDCClient

log = logging.getLogger(__name__)


def define_namespaces(controller: str, names: list[str], replicas: int) -> None:
    """Give the stack's namespaces `replicas` copies before any instance uses them (an implicit
    creation by an instance would be one copy). A namespace someone defined explicitly (a
    shared pool) is left as it is, with a warning if its count differs."""
    from matrixinfer.ems.protocol import call_once, ns_create_header

    for name in names:
        reply = call_once(controller, ns_create_header(name, replicas=replicas, if_absent=True))
        if reply["replicas"] != replicas:
            log.warning("EMS namespace %r keeps its %d replica(s) (defined before this stack); asked for %d",
                        name, reply["replicas"], replicas)


def start_pdc(base: EngineConfig, prefill_instances: int = 1, decode_instances: int = 1, ems_servers: int = 1,
              ems_controller: str | None = None, router: str = "least-loaded", model_name: str | None = None,
              ems_dram_mb: int = 256, restart_instances: bool = True, ray_address: str | None = None,
              decode: EngineConfig | None = None, ems_replicas: int = 1) -> PDCClient:
    """`base`: the prefill instances' configuration, and the decode instances' unless `decode`
    gives theirs (a deployment file's roles differ: SP-TP-SP prefill, an EP decode).
    `ems_controller`: join an existing EMS pool; otherwise start one with `ems_servers`
    MP servers, owned by the returned client (its shutdown() stops it). `ray_address`: place
    the instances and the EMS processes as actors on that Ray cluster instead of here.
    `ems_replicas`: copies of each object in the stack's namespaces (KV pages, model cache)."""
    if prefill_instances < 1 or decode_instances < 1:
        raise ValueError("a PDC stack needs at least one prefill and one decode instance")
    cluster, root = None, None
    if ray_address is not None:
        from matrixinfer.pdc.ray_placement import RayEMSCluster, connect

        connect(ray_address)
        if ems_controller is None:
            if ems_servers < 1:
                raise ValueError("the KV hand-off goes through EMS: give --ems-servers >= 1 or --ems-controller")
            cluster = RayEMSCluster(ems_servers, ems_dram_mb)
            ems_controller = cluster.controller
    elif ems_controller is None:
        if ems_servers < 1:
            raise ValueError("the KV hand-off goes through EMS: give --ems-servers >= 1 or --ems-controller")
        from matrixinfer.ems import LocalCluster

        root = tempfile.mkdtemp(prefix="matrixinfer-ems-")
        cluster = LocalCluster(n_servers=ems_servers, root=root, dram_bytes=ems_dram_mb << 20)
        try:
            cluster.start()
        except BaseException:
            cluster.close()
            shutil.rmtree(root, ignore_errors=True)
            raise
        ems_controller = cluster.controller

    def stop_cluster() -> None:
        if cluster is not None:
            cluster.close()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    kv = KVTransferConfig(connector="ems", ems_controller=ems_controller, ems_namespace=base.kv_transfer.ems_namespace)
    if ems_replicas != 1:
        try:
            from matrixinfer.ems.model_cache import MODEL_NAMESPACE

            define_namespaces(ems_controller, [kv.ems_namespace, MODEL_NAMESPACE], ems_replicas)
        except BaseException:
            stop_cluster()
            raise
    cfg = replace(base, kv_transfer=kv)
    # Prefill instances never run a decode step (they hand off after the first token): they
    # compile their prefill steps only. An SP-TP-SP prefill layout is the prefill role's (and
    # runs eager); decode instances keep the base layout without it (they continue from the
    # latent KV the prefill saved to EMS), or run a layout of their own.
    prefill_cfg = replace(cfg, compile_decode=False)
    decode_cfg = cfg if decode is None else replace(decode, kv_transfer=kv)
    if decode_cfg.parallel.sequence_parallel:
        decode_cfg = replace(decode_cfg, parallel=replace(decode_cfg.parallel, prefill_parallel=None,
                                                          prefill_parallel_size=1))
    if ray_address is None and cfg.num_threads is None:
        # every instance on this machine: split the cores instead of each taking all of them
        ranks = prefill_instances * prefill_cfg.parallel.world_size + decode_instances * decode_cfg.parallel.world_size
        threads = max(1, (os.cpu_count() or 1) // ranks)
        prefill_cfg, decode_cfg = replace(prefill_cfg, num_threads=threads), replace(decode_cfg, num_threads=threads)
    try:
        client = PDCClient([prefill_cfg] * prefill_instances, [decode_cfg] * decode_instances, model_name, router,
                           stop_cluster, restart_instances, ray=ray_address is not None)
        client.ems_cluster = cluster  # None when it joined an existing pool
        return client
    except BaseException:
        stop_cluster()
        raise
