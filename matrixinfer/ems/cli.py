"""CLI subcommands of this subsystem (registered by matrixinfer.cli).

    matrixinfer ems controller --port P
    matrixinfer ems server --controller HOST:P --dram-bytes 1G --ssd-dir DIR [--port Q]
    matrixinfer ems model-load --controller HOST:P --model DIR [--bandwidth-mbps 200]
    matrixinfer ems stats --controller HOST:P
    matrixinfer ems ns-create --controller HOST:P --name NS [--replicas 2] [--dram-bytes 1G] [--ssd-bytes 8G]
    matrixinfer ems ns-list --controller HOST:P
    matrixinfer bench ems [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .config import ControllerConfig, ServerConfig

# Beside the token service's database (matrixinfer.serving.db), without importing it.
DEFAULT_CONTROLLER_DB = Path(os.environ.get("MATRIXINFER_HOME", Path.home() / ".matrixinfer")) / "ems-controller.db"


def parse_bytes(text: str) -> int:
    """'1G', '256M', '64KiB', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", str(text), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M, 4G)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _controller(args) -> int:
    from .controller import run_controller

    return run_controller(ControllerConfig(host=args.host, port=args.port, heartbeat_timeout_s=args.heartbeat_timeout,
                                           vnodes=args.vnodes, db=args.db or None))


def _server(args) -> int:
    from .server import run_server

    cfg = ServerConfig(controller=args.controller, host=args.host, port=args.port, dram_bytes=args.dram_bytes,
                       ssd_dir=args.ssd_dir, server_id=args.id, fsync=args.fsync, heartbeat_s=args.heartbeat,
                       huge_pages=args.huge_pages, numa_node=args.numa_node, drain_timeout_s=args.drain_timeout)
    return run_server(cfg)


def _model_load(args) -> int:
    from .model_cache import load_model_cli

    if not args.model and not args.source:
        raise SystemExit("model-load needs --model DIR or --source HOST:PORT")
    if not args.direct and not args.controller:
        raise SystemExit("model-load needs --controller HOST:PORT (or --direct)")
    return load_model_cli(args)


def _source(args) -> int:
    from .model_cache import run_source_server

    return run_source_server(args.model, args.bandwidth_mbps * 1e6, args.port)


def _stats(args) -> int:
    from .client import EMSClient

    with EMSClient(args.controller) as c:
        print(json.dumps(c.stats(), indent=2))
    return 0


def _ns_create(args) -> int:
    from .protocol import EMSError, call_once, ns_create_header

    try:
        header = ns_create_header(args.name, args.dram_bytes, args.ssd_bytes, args.replicas, args.if_absent)
        reply = call_once(args.controller, header)
    except EMSError as e:
        print(f"ems ns-create: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"name": args.name, "created": reply["created"], "replicas": reply["replicas"]}))
    return 0


def _ns_list(args) -> int:
    from .protocol import call_once

    print(json.dumps(call_once(args.controller, {"op": "ns_list"})["namespaces"], indent=2))
    return 0


def register(sub, bench_sub) -> None:
    ems = sub.add_parser("ems", help="Elastic Memory Service: controller, MP servers, model cache")
    ems_sub = ems.add_subparsers(dest="ems_command", required=True)

    p = ems_sub.add_parser("controller", help="membership, hash ring, namespaces (metadata only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7900)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds before a silent server is dropped")
    p.add_argument("--vnodes", type=int, default=160, help="virtual nodes per server on the ring")
    p.add_argument("--db", default=str(DEFAULT_CONTROLLER_DB),
                   help="SQLite file keeping namespaces, quotas and members across restarts "
                        "(default %(default)s; '' keeps nothing)")
    p.set_defaults(func=_controller)

    p = ems_sub.add_parser("server", help="one MP server: DRAM arena over an SSD log")
    p.add_argument("--controller", required=True, help="HOST:PORT of the controller")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port")
    p.add_argument("--dram-bytes", type=parse_bytes, default=parse_bytes("256M"))
    p.add_argument("--ssd-dir", required=True)
    p.add_argument("--id", default=None, help="server id (default: derived from --ssd-dir)")
    p.add_argument("--fsync", choices=["always", "never"], default="always", help="always: acknowledge puts only after fsync")
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--huge-pages", choices=["auto", "on", "off"], default="auto",
                   help="arena on huge pages: hugetlbfs if mounted with room, else transparent huge pages where "
                        "shmem_enabled allows (auto falls back to 4 KiB pages; on fails instead)")
    p.add_argument("--numa-node", default="auto", help="auto: the node of the CPU the server starts on, where "
                   "there are several; off; or a node number")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="on SIGTERM, seconds for requests in flight")
    p.set_defaults(func=_server)

    p = ems_sub.add_parser("model-load", help="load a checkpoint through the EMS model cache")
    p.add_argument("--controller", help="HOST:PORT of the EMS controller (not needed with --direct)")
    p.add_argument("--model", default="", help="directory with *.safetensors (the source)")
    p.add_argument("--source", default=None, help="HOST:PORT of an `ems source` server instead of --model")
    p.add_argument("--namespace", default="model-cache")
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="throttle reads of --model (MB/s; 0 = unthrottled)")
    p.add_argument("--direct", action="store_true", help="baseline: read everything from the source, bypass EMS")
    p.add_argument("--wait-go", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=_model_load)

    p = ems_sub.add_parser("source", help="serve a checkpoint directory at a capped bandwidth (object-storage stand-in)")
    p.add_argument("--model", required=True)
    p.add_argument("--bandwidth-mbps", type=float, default=200.0)
    p.add_argument("--port", type=int, default=0)
    p.set_defaults(func=_source)

    p = ems_sub.add_parser("stats", help="print every MP server's stats")
    p.add_argument("--controller", required=True)
    p.set_defaults(func=_stats)

    p = ems_sub.add_parser("ns-create", help="create or redefine a namespace: quotas and replicas")
    p.add_argument("--controller", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--replicas", type=int, default=None, help="copies of each object on distinct servers (default 1)")
    p.add_argument("--dram-bytes", type=parse_bytes, default=None, help="pool-wide DRAM quota (default unlimited)")
    p.add_argument("--ssd-bytes", type=parse_bytes, default=None, help="pool-wide SSD quota (default unlimited)")
    p.add_argument("--if-absent", action="store_true", help="leave an explicitly defined namespace as it is")
    p.set_defaults(func=_ns_create)

    p = ems_sub.add_parser("ns-list", help="print the namespaces with their quotas and replicas")
    p.add_argument("--controller", required=True)
    p.set_defaults(func=_ns_list)

