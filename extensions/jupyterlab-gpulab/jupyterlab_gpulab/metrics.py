"""Prometheus metrics of the latest sample, on a private registry (names are a fixed contract)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .sampler import Sample

MIB = 1024 * 1024
LABELS = ["gpu", "user", "server"]


class GPUCollector(Collector):
    """Reads the monitor's state at scrape time; nothing is updated between scrapes."""

    def __init__(
        self,
        user: str,
        server: str,
        latest: Callable[[], Sample | None],
        active_alerts: Callable[[], list[dict[str, Any]]],
        simulated: Callable[[], bool],
    ) -> None:
        self.user, self.server = user, server
        self.latest, self.active_alerts, self.simulated = latest, active_alerts, simulated

    def collect(self) -> Iterator[GaugeMetricFamily]:
        def family(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*LABELS, *extra])

        util = family(
            "gpulab_gpu_utilization_ratio",
            "GPU utilisation, 0-1 (device-wide unless the sample says own_processes)",
        )
        used = family("gpulab_gpu_memory_used_bytes", "GPU memory in use by this server's share")
        limit = family("gpulab_gpu_memory_limit_bytes", "GPU memory this server may use")
        temp = family("gpulab_gpu_temperature_celsius", "GPU temperature (whole GPUs only)")
        power = family("gpulab_gpu_power_watts", "GPU power draw (whole GPUs only)")
        proc = family(
            "gpulab_gpu_process_memory_bytes",
            "GPU memory of each of the user's processes",
            ("pid",),
        )
        alert = family("gpulab_alert_active", "1 while an alert rule fires", ("alert", "severity"))
        simulated = family(
            "gpulab_monitor_simulated", "1 when the figures come from simulated GPUs"
        )

        sample = self.latest()
        for uuid, d in (sample.devices if sample else {}).items():
            labels = [uuid, self.user, self.server]
            if d.utilization_pct is not None:
                util.add_metric(labels, d.utilization_pct / 100)
            used.add_metric(labels, d.memory_used_mib * MIB)
            limit.add_metric(labels, d.memory_limit_mib * MIB)
            if d.temperature_c is not None:
                temp.add_metric(labels, d.temperature_c)
            if d.power_w is not None:
                power.add_metric(labels, d.power_w)
            for p in d.processes:
                if p.own:
                    proc.add_metric([*labels, str(p.pid)], p.memory_mib * MIB)
        for event in self.active_alerts():
            alert.add_metric(
                [
                    str(event.get("device") or ""),
                    self.user,
                    self.server,
                    str(event["rule"]),
                    str(event["severity"]),
                ],
                1,
            )
        simulated.add_metric(["", self.user, self.server], 1 if self.simulated() else 0)
        # families without a value (no temperature on a shared GPU) are left out, not zero
        yield from (f for f in (util, used, limit, temp, power, proc, alert) if f.samples)
        yield simulated


def make_registry(collector: GPUCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
