"""Peer-to-peer Prefill / Decode / Caching serving: instances as processes, the KV hand-off
through the EMS pool, the peer scheduler (least-loaded, locality, round-robin), failover."""

from matrixinfer.pdc.client import NoInstanceError, PDCClient
from matrixinfer.pdc.launch import start_pdc

__all__ = ["PDCClient", "NoInstanceError", "start_pdc"]
