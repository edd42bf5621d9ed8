"""A job run's or a Dask worker's GPU report: its share's figures pushed to gpulab-metrics.

A server's GPU monitor pushes its share's utilisation and memory (push.py); a job run or a Dask
worker runs no JupyterLab, so without this its GPU-hours could only be called "unmonitored". The
hub hands each such workload a report (`gpulab.spawner.names`: REPORT_URL_ENV, REPORT_TOKEN_ENV,
REPORT_NAME_ENV, REPORT_USER_ENV and PUSH_INTERVAL_ENV, as a mapping): the job wrapper reads it
from its spec and runs a `WorkloadReporter` in a thread of its own; the Dask worker preload reads
it from the worker's environment and runs one on the worker's loop, over the sampler it already
has for the dashboard.

The figures are the same share-aware ones a server's panel shows (`sources.select_source` from
the workload's GPULAB_* share environment: on a fraction, the owner's own processes where NVML
says so), in the same exposition, so gpulab-metrics records them exactly as a server's: used
GPU-seconds for the ledger, live figures for the admin panel.

The token is the workload's own (gpulab.hub.report_tokens): it can report for this workload only
and is revoked when its share is given back; it never reaches the job's environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gpulab.spawner.names import (
    MONITOR_SOURCE_ENV,
    REPORT_NAME_ENV,
    REPORT_TOKEN_ENV,
    REPORT_URL_ENV,
    REPORT_USER_ENV,
    SIMULATED_GPU_FILE_ENV,
    is_workload_name,
)

from .metrics import GPUCollector, exposition, make_registry
from .push import MetricsPusher, push_settings_from_env
from .sampler import Sample, Sampler
from .share import Share, share_from_env
from .sources import Source, select_source

log = logging.getLogger(__name__)

#: the reporter's own sampler (when it has none to share) samples this often, at most
MAX_PERIOD_SECONDS = 5.0
#: the last push waits this long after the one before (gpulab-metrics refuses pushes closer
#: together than MetricsService.min_push_interval_seconds, at most 1 s)
FINAL_PUSH_GAP_SECONDS = 1.05


@dataclass(frozen=True)
class Report:
    """Where and as whom a workload reports (see the module docstring)."""

    url: str
    token: str
    user: str
    name: str
    interval_seconds: float
    #: how to measure, as the hub measures its servers (MONITOR_SOURCE_ENV and
    #: SIMULATED_GPU_FILE_ENV of its Spawner.environment); "": the workload's own environment's
    source: str = ""
    simulated_file: str = ""

    @classmethod
    def from_mapping(cls, values: Mapping[str, str]) -> Report | None:
        """The report in `values` (a spec's or an environment's); None when there is none.
        ValueError, naming the variable, for one that is there but wrong."""
        url = str(values.get(REPORT_URL_ENV, "")).strip()
        token = str(values.get(REPORT_TOKEN_ENV, "")).strip()
        if not url or not token:
            return None
        user = str(values.get(REPORT_USER_ENV, "")).strip()
        name = str(values.get(REPORT_NAME_ENV, "")).strip()
        if not user:
            raise ValueError(f"{REPORT_USER_ENV} is empty: the hub names the workload's owner")
        if not is_workload_name(name):
            raise ValueError(f"{REPORT_NAME_ENV}={name!r} is no job run's or Dask worker's name")
        _url, interval = push_settings_from_env(values)  # as a server's monitor reads it
        return cls(
            url,
            token,
            user,
            name,
            interval,
            str(values.get(MONITOR_SOURCE_ENV, "")).strip(),
            str(values.get(SIMULATED_GPU_FILE_ENV, "")).strip(),
        )


class WorkloadReporter:
    """Samples the workload's share (or reads `latest`, a sampler it shares) and pushes the
    figures every `report.interval_seconds`; `stop()` pushes once more, so the last stretch
    before the workload ends is counted too."""

    def __init__(
        self,
        report: Report,
        *,
        share: Share | None = None,
        source: Source | None = None,
        latest: Callable[[], Sample | None] | None = None,
        simulated: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        self.report = report
        self.share = replace(share or share_from_env(env), user=report.user, server=report.name)
        self.source: Source | None = None
        self.sampler: Sampler | None = None
        if latest is None:
            self.source = source or select_source(
                report.source or env.get(MONITOR_SOURCE_ENV, "") or "auto",
                self.share,
                script_path=report.simulated_file or env.get(SIMULATED_GPU_FILE_ENV) or None,
            )
            self.sampler = Sampler(
                self.source,
                min(MAX_PERIOD_SECONDS, report.interval_seconds),
                history_seconds=2 * MAX_PERIOD_SECONDS,
            )
            latest = self.sampler.latest
        # with a shared sampler (`latest`), its owner says whether its source is simulated
        if self.source is not None:
            simulated = self.source.simulated
        self.registry = make_registry(
            GPUCollector(report.user, report.name, latest, list, lambda: simulated)
        )
        self.pusher = MetricsPusher(
            report.url,
            report.token,
            report.user,
            report.name,
            self.body,
            report.interval_seconds,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def body(self) -> bytes:
        return exposition(self.registry)

    # -- on a running loop (a Dask worker's) ---------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.sampler is not None:
            self.sampler.start()
            self.sampler.sample_once()  # the first push has a figure to send
        self._loop = loop
        self.pusher.start(loop)
        log.info(
            "gpulab: reporting %s/%s's GPU figures to %s every %g s",
            self.report.user,
            self.report.name,
            self.report.url,
            self.report.interval_seconds,
        )

    async def close(self) -> None:
        """Stop pushing, then push the figures once more."""
        if self.pusher.task is not None:
            self.pusher.task.cancel()
            self.pusher.task = None
        if self.sampler is not None:  # its thread stops; one last sample here
            self.sampler.stop()
            self.sampler.sample_once()
        if self.pusher.last_push is not None:
            # the service refuses pushes closer than its minimum interval (at most 1 s)
            await asyncio.sleep(
                max(0.0, FINAL_PUSH_GAP_SECONDS - (time.time() - self.pusher.last_push))
            )
        await self.pusher.push_once()
        self.pusher.stop()
        if self.source is not None:
            self.source.close()

    # -- in a thread of its own (the job wrapper's) --------------------------------------------

    def start_in_thread(self) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.start(loop)
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="gpulab-gpu-report", daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop_thread(self, timeout: float = 10.0) -> None:
        """From another thread: the last push, then the thread ends (at most `timeout` s)."""
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def finish() -> None:
            try:
                await asyncio.wait_for(self.close(), timeout)
            finally:
                loop.stop()

        asyncio.run_coroutine_threadsafe(finish(), loop)
        self._thread.join(timeout + 1)


def reporter_from_mapping(
    values: Mapping[str, str],
    *,
    latest: Callable[[], Sample | None] | None = None,
    simulated: bool = False,
) -> WorkloadReporter | None:
    """A reporter for the report in `values` (None without one, or when it cannot start: the
    workload runs on without its figures, and says why once)."""
    try:
        report = Report.from_mapping(values)
        if report is None:
            return None
        return WorkloadReporter(report, latest=latest, simulated=simulated)
    except Exception as e:
        log.warning("gpulab: this workload's GPU figures are not reported: %s", e)
        return None
