"""gpulab_cull_decisions_total on the hub's /hub/metrics (JupyterHub's Prometheus registry).

Labels are the decision's bounded ones (verdict, first cause, profile, mode): no user or server
names, so the series stay few whatever the number of users.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

LABELS = ("verdict", "cause", "profile", "mode")


class CullDecisionsCollector(Collector):
    """Counts every decision the culler made since the hub started."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, ...]] = Counter()

    def count(self, labels: Mapping[str, str]) -> None:
        self.counts[tuple(labels[name] for name in LABELS)] += 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gpulab_cull_decisions",
            "GPU-aware culling decisions, by verdict, first cause, profile and mode (live/dry-run).",
            labels=list(LABELS),
        )
        for labels, n in sorted(self.counts.items()):
            family.add_metric(list(labels), n)
        yield family
