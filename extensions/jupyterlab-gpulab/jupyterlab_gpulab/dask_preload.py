"""Dask worker preload: the dashboard's GPU panes show the worker's share, not the whole device.

Executors start every gpulab Dask worker with ``--preload jupyterlab_gpulab.dask_preload``.
distributed's own GPU figures (its SystemMonitor's ``gpu_utilization``, ``gpu_memory_used`` and
``gpu-memory-total``, and the ``gpu`` metric) read the first visible device through NVML: on a
1/4 share of a GPU that is the whole card, neighbours' memory and work included. Here they come
from the GPU monitor's share-aware source (``jupyterlab_gpulab.sources``, the same one a server's
GPU panel uses, chosen from the worker's GPULAB_* share environment): memory against the share's
limit, and on a fraction the worker's own processes only.

The source is sampled by the monitor's ``Sampler`` thread (NVML calls may block for
milliseconds); the worker's periodic monitor update only reads the latest sample, so the event
loop never waits for the driver. A worker without a GPU share reports no GPU at all, even where
the machine has GPUs (they are not its own).

The same samples are the worker's GPU report (``jupyterlab_gpulab.reporter``): where the hub runs
gpulab-metrics it gives each worker holding a GPU share a report in its environment (REPORT_*_ENV
of ``gpulab.spawner.names``), and a ``WorkloadReporter`` on the worker's own event loop pushes the
share's figures for ``<owner>/dask-<cluster>-w<n>``, so the ledger measures the worker's GPU-hours
as a server's. Its token is worth only reporting for this one worker and dies with the share; it
is taken out of ``os.environ`` once read, so the processes the owner's tasks start do not inherit
it. ``dask_teardown`` pushes the last stretch before the worker (and then its share) goes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from gpulab.spawner.names import MONITOR_SOURCE_ENV, REPORT_TOKEN_ENV, SIMULATED_GPU_FILE_ENV

from .reporter import WorkloadReporter, reporter_from_mapping
from .sampler import Sample, Sampler
from .share import Share, share_from_env
from .sources import DeviceInfo, Source, select_source

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: distributed's SystemMonitor quantities the dashboard's GPU panes read
GPU_QUANTITIES = ("gpu_utilization", "gpu_memory_used", "gpu-memory-total")
#: how often the share is sampled (distributed's own monitor runs every 0.5 s)
PERIOD_SECONDS = 1.0
#: the final push at teardown waits at most this long: the executor kills a worker that
#: outstays its stop grace, and a hung push must not be why
FINAL_PUSH_SECONDS = 5.0
#: the report's first push waits at most this long for the sampler's first sample
FIRST_SAMPLE_SECONDS = 2 * PERIOD_SECONDS


def gpu_name(devices: list[DeviceInfo], share: Share) -> str:
    """What the dashboard calls the worker's GPU: the device, and the share when a fraction."""
    if not devices:
        return ""
    names = sorted({d.name for d in devices})
    label = ", ".join(names) + (f" x{len(devices)}" if len(devices) > 1 else "")
    if share.fraction is not None:
        label += f" ({share.profile or f'{share.fraction:g} share'})"
    return label


def memory_total_bytes(devices: list[DeviceInfo]) -> int:
    """The share's memory: each device's limit (a fraction's cap, else the whole memory)."""
    return int(sum(d.memory_limit_mib for d in devices) * MIB)


def share_figures(sample: Sample | None, devices: list[DeviceInfo]) -> dict[str, float] | None:
    """distributed's GPU quantities from one monitor sample (None before the first): memory
    used and the share's total in bytes, utilisation in percent (the mean over the devices of
    the share; a device without a figure counts 0)."""
    if sample is None or not devices:
        return None
    present = [sample.devices[d.uuid] for d in devices if d.uuid in sample.devices]
    if not present:
        return None
    utilization = sum(s.utilization_pct or 0.0 for s in present) / len(present)
    return {
        "gpu_utilization": round(utilization, 1),
        "gpu_memory_used": int(sum(s.memory_used_mib for s in present) * MIB),
        "gpu-memory-total": memory_total_bytes(devices),
    }


class ShareMonitor:
    """Replaces a worker's GPU figures with the share's (see the module docstring)."""

    def __init__(self, worker: Any, source: Source, share: Share) -> None:
        self.worker = worker
        self.source = source
        self.share = share
        self.devices = source.devices()
        self.sampler = Sampler(source, PERIOD_SECONDS, history_seconds=10 * PERIOD_SECONDS)
        monitor = worker.monitor
        self._original_update = monitor.update
        self.name = gpu_name(self.devices, share)

    def install(self) -> None:
        monitor = self.worker.monitor
        # distributed's update reads NVML when it has a gpu_name: it must not (a whole-device
        # figure), so it runs without one and the share's figures are added after it
        monitor.gpu_name = None
        for key in GPU_QUANTITIES:
            monitor.quantities.pop(key, None)
        self.worker.metrics.pop("gpu", None)
        self.worker.startup_information.pop("gpu", None)
        if not self.devices:
            monitor.gpu_memory_total = -1
            return
        self.sampler.start()
        # the monitor's recent() reads every quantity's last value: each starts with one (the
        # share's total, nothing used yet) until the sampler thread's first sample arrives
        total = memory_total_bytes(self.devices)
        for key, first in zip(GPU_QUANTITIES, (0.0, 0, total), strict=True):
            queue = type(monitor.quantities["cpu"])(
                maxlen=1 if key == "gpu-memory-total" else monitor.quantities["cpu"].maxlen
            )
            queue.append(first)
            monitor.quantities[key] = queue
        monitor.gpu_memory_total = total
        monitor.gpu_name = self.name
        monitor.update = self.update
        # the worker's periodic callback holds the bound method it was made with
        callback = self.worker.periodic_callbacks.get("monitor")
        if callback is not None:
            callback.callback = self.update
        self.worker.metrics["gpu"] = self.gpu_metric
        self.worker.startup_information["gpu"] = self.gpu_startup

    def update(self) -> dict[str, Any]:
        monitor = self.worker.monitor
        monitor.gpu_name = None
        try:
            result: dict[str, Any] = self._original_update()
        finally:
            monitor.gpu_name = self.name or None
        figures = share_figures(self.sampler.latest(), self.devices)
        if figures is not None:
            monitor.gpu_memory_total = figures["gpu-memory-total"]
            for key, value in figures.items():
                monitor.quantities[key].append(value)
            result.update(figures)
        return result

    async def gpu_metric(self, worker: Any) -> dict[str, float]:
        figures = share_figures(self.sampler.latest(), self.devices) or {}
        return {
            "utilization": figures.get("gpu_utilization", 0.0),
            "memory-used": figures.get("gpu_memory_used", 0),
        }

    def gpu_startup(self, worker: Any) -> dict[str, Any]:
        return {"memory-total": memory_total_bytes(self.devices), "name": self.name}

    def close(self) -> None:
        self.sampler.stop()
        self.source.close()


async def dask_setup(worker: Any) -> None:
    """distributed's preload hook (``--preload jupyterlab_gpulab.dask_preload``), awaited on the
    worker's event loop as it starts."""
    share = share_from_env()
    source = select_source(
        os.environ.get(MONITOR_SOURCE_ENV, "auto") or "auto",
        share,
        script_path=os.environ.get(SIMULATED_GPU_FILE_ENV) or None,
    )
    monitor = ShareMonitor(worker, source, share)
    monitor.install()
    worker._gpulab_share_monitor = monitor
    log.info(
        "gpulab: the dashboard's GPU figures are this worker's share (%s source, %d device(s)%s)",
        source.kind,
        len(monitor.devices),
        f", {share.profile}" if share.profile else "",
    )
    worker._gpulab_reporter = await start_report(monitor, os.environ)


async def start_report(monitor: ShareMonitor, environ: Any) -> WorkloadReporter | None:
    """The worker's GPU report started on the running loop (the worker's), over the monitor's
    samples; None without a report or without a GPU share (nothing to report: no devices, no
    sampler). The token is removed from `environ` either way: the owner's task subprocesses
    need not carry it (it could only report for this worker, but the fewer copies the better)."""
    try:
        reporter = (
            reporter_from_mapping(
                environ, latest=monitor.sampler.latest, simulated=monitor.source.simulated
            )
            if monitor.devices
            else None
        )
    finally:
        environ.pop(REPORT_TOKEN_ENV, None)
    if reporter is None:
        return None
    # the first push goes out at once: it carries figures once the sampler thread's first
    # sample is in (milliseconds; waited for without blocking the loop, and not forever)
    for _ in range(round(FIRST_SAMPLE_SECONDS / 0.05)):
        if monitor.sampler.latest() is not None:
            break
        await asyncio.sleep(0.05)
    reporter.start(asyncio.get_running_loop())
    return reporter


async def dask_teardown(worker: Any) -> None:
    """distributed's preload teardown (awaited as the worker closes, its share still held):
    the report's last push, then the sampler stops."""
    reporter: WorkloadReporter | None = getattr(worker, "_gpulab_reporter", None)
    if reporter is not None:
        worker._gpulab_reporter = None
        try:
            await asyncio.wait_for(reporter.close(), FINAL_PUSH_SECONDS)
        except Exception as e:  # the worker closes anyway; the stretch since the last push is lost
            log.warning("gpulab: the GPU report's last push failed: %r", e)
    monitor = getattr(worker, "_gpulab_share_monitor", None)
    if monitor is not None:
        monitor.close()
