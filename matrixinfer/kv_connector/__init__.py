"""KV connectors: how KV blocks enter and leave an engine instance (scheduler and worker halves)."""

from matrixinfer.kv_connector.base import KVConnectorScheduler, KVConnectorWorker


def make_scheduler_connector(cfg, kv_manager) -> KVConnectorScheduler | None:
    if cfg.connector is None:
        return None
    from matrixinfer.kv_connector.ems_connector import EMSConnectorScheduler

    return EMSConnectorScheduler(cfg, kv_manager)


def make_worker_connector(cfg, tp_rank: int) -> KVConnectorWorker | None:
    """The worker half; TP rank 0 saves (the other TP ranks hold the same latent)."""
    if cfg.connector is None:
        return None
    from matrixinfer.kv_connector.ems_connector import EMSConnectorWorker

    return EMSConnectorWorker(cfg, saves=tp_rank == 0)


__all__ = ["KVConnectorScheduler", "KVConnectorWorker", "make_scheduler_connector", "make_worker_connector"]
