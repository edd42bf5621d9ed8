"""The ledger's figures on the hub's /hub/metrics (JupyterHub's Prometheus registry).

JupyterHub renders its registry on the event loop, so the collector only reads figures that the
ledger's writer refreshed in its worker thread (every `budget_check_interval_seconds`); it never
queries the database itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpulab.hub.ledger.quota import every_budget
from gpulab.hub.ledger.store import LedgerStore

MILLI_HOUR = 1000 * 3600


class LedgerCollector(Collector):
    """gpulab_gpu_hours_allocated_total{user,profile,workload},
    gpulab_gpu_hours_used_total{user}, gpulab_gpu_hour_budget_remaining{scope,name}."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.allocated: list[tuple[str, str, str, int]] = []
        self.used: dict[str, float] = {}

    def refresh(self, store: LedgerStore, now: int) -> None:
        """Read the totals (a worker thread)."""
        self.allocated = store.allocated_totals(now)
        self.used = store.used_totals()

    def collect(self) -> Iterator[Metric]:
        allocated = CounterMetricFamily(
            "gpulab_gpu_hours_allocated",
            "GPU-hours allocated (fraction of a GPU x hours held), by user, profile, workload.",
            labels=["user", "profile", "workload"],
        )
        for user, profile, workload, milli_seconds in self.allocated:
            allocated.add_metric([user, profile, workload], milli_seconds / MILLI_HOUR)
        yield allocated
        used = CounterMetricFamily(
            "gpulab_gpu_hours_used",
            "GPU-hours the GPU monitor saw used by each user's servers.",
            labels=["user"],
        )
        for user, seconds in sorted(self.used.items()):
            used.add_metric([user], seconds / 3600)
        yield used
        remaining = GaugeMetricFamily(
            "gpulab_gpu_hour_budget_remaining",
            "GPU-hours left in each GPU-hour budget's window.",
            labels=["scope", "name"],
        )
        ledger = self.ledger
        for b in every_budget(ledger.quota, ledger.window_users, ledger.window_groups):
            remaining.add_metric([b.scope, b.name], b.remaining_gpu_hours)
        yield remaining
