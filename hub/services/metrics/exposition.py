"""The gpulab-metrics service's Prometheus exposition: pushed series, push health, alerts."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpulab.hub.services.metrics.aggregate import Aggregate

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

        # the name of Prometheus' own per-target health series, kept for dashboards written when
        # the service scraped: 1 while the server's pushes are current
        up = GaugeMetricFamily(
            "gpulab_scrape_up",
            "1 while the server pushes its GPU figures (its last push is not stale)",
            labels=SERVER_LABELS,
        )
        last_push = GaugeMetricFamily(
            "gpulab_push_last_timestamp_seconds",
            "When the server's last accepted push arrived (unix time)",
            labels=SERVER_LABELS,
        )
        for state in agg.servers.values():
            labels = [state.target.user, state.target.server]
            up.add_metric(labels, 1.0 if state.up else 0.0)
            if state.last_push is not None:
                last_push.add_metric(labels, state.last_push)
        yield up
        yield last_push

        alert = GaugeMetricFamily(
            "gpulab_hub_alert_active",
            "1 while a hub-side alert rule (gpulab-metrics rules) fires",
            labels=["alert", "severity", "user", "server", "gpu"],
        )
        for e in agg.active():
            alert.add_metric([e["rule"], e["severity"], e["user"], e["server"], e["gpu"]], 1.0)
        yield alert
        yield GaugeMetricFamily(
            "gpulab_metrics_servers", "Running servers the service knows", value=len(agg.servers)
        )
        yield GaugeMetricFamily(
            "gpulab_metrics_cycle_seconds",
            "How long the last listing of running servers took",
            value=agg.last_cycle_seconds,
        )
        for name, doc, value in (
            ("gpulab_metrics_cycles", "Listings of running servers", agg.cycles),
            ("gpulab_metrics_pushes", "Pushes accepted", agg.pushes_total),
            ("gpulab_metrics_push_refusals", "Pushes refused", agg.push_refusals_total),
        ):
            counter = Metric(name, doc, "counter")
            counter.add_sample(f"{name}_total", {}, float(value))
            yield counter


def exposition(aggregate: Aggregate) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregateCollector(aggregate))
    return generate_latest(registry)
