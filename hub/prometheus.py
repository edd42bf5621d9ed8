"""gpulab's collectors on the hub's /hub/metrics (JupyterHub's Prometheus registry)."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.registry import Collector

_registered: dict[str, Collector] = {}


def register_collector(name: str, collector: Collector) -> None:
    """Register `collector` as `name`, in place of the one registered under that name before
    (a hub made twice in one process: tests): a registry refuses a second collector of the same
    metric names."""
    old = _registered.pop(name, None)
    if old is not None:
        REGISTRY.unregister(old)
    REGISTRY.register(collector)
    _registered[name] = collector
