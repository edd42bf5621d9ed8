"""The gpulab-metrics service's Prometheus exposition: scraped series, scrape health, alerts."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics_aggregate import Aggregate

SERVER_LABELS = ["user", "server"]


class AggregateCollector(Collector):
    """Reads the aggregate at scrape time (Prometheus' pull model: nothing copied in between)."""

    def __init__(self, aggregate: Aggregate) -> None:
        self.aggregate = aggregate

    def collect(self) -> Iterator[Metric]:
        agg = self.aggregate
        merged: dict[str, Metric] = {}
        for state in agg.servers.values():
            if not state.up or state.result is None:
                continue  # a server that does not answer has no current figures
            for family in state.result.families:
                metric = merged.get(family.name)
                if metric is None:
                    metric = merged[family.name] = Metric(
                        family.name, family.documentation, family.type
                    )
                elif metric.type != family.type:
                    continue  # another server says it is something else: first one wins
                for s in family.series:
                    metric.add_sample(s.name, dict(s.labels), s.value)
        yield from merged.values()

        up = GaugeMetricFamily(
            "gpulab_scrape_up",
            "1 if the server's GPU monitor answered the last scrape",
            labels=SERVER_LABELS,
        )
        duration = GaugeMetricFamily(
            "gpulab_scrape_duration_seconds", "How long the last scrape took", labels=SERVER_LABELS
        )
        for state in agg.servers.values():
            labels = [state.target.user, state.target.server]
            up.add_metric(labels, 1.0 if state.up else 0.0)
            if state.last_attempt is not None:
                duration.add_metric(labels, state.duration_seconds)
        yield up
        yield duration

        alert = GaugeMetricFamily(
            "gpulab_hub_alert_active",
            "1 while a hub-side alert rule (gpulab-metrics rules) fires",
            labels=["alert", "severity", "user", "server", "gpu"],
        )
        for e in agg.active():
            alert.add_metric([e["rule"], e["severity"], e["user"], e["server"], e["gpu"]], 1.0)
        yield alert
        yield GaugeMetricFamily(
            "gpulab_metrics_servers", "Running servers the service scrapes", value=len(agg.servers)
        )
        yield GaugeMetricFamily(
            "gpulab_metrics_cycle_seconds",
            "How long the last scrape cycle (hub listing and all scrapes) took",
            value=agg.last_cycle_seconds,
        )
        cycles = Metric("gpulab_metrics_cycles", "Scrape cycles run", "counter")
        cycles.add_sample("gpulab_metrics_cycles_total", {}, float(agg.cycles))
        yield cycles
        failures = Metric("gpulab_metrics_scrape_failures", "Failed scrapes", "counter")
        failures.add_sample(
            "gpulab_metrics_scrape_failures_total",
            {},
            float(agg.scrape_failures_total),
        )
        yield failures


def exposition(aggregate: Aggregate) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregateCollector(aggregate))
    return generate_latest(registry)
