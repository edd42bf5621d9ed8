"""The Dask worker preload: a real scheduler and worker (in this process) whose dashboard GPU
pane reads the worker's share, from the monitor's simulated source (no GPU on CI machines)."""

from __future__ import annotations

import asyncio
import os

from distributed import Scheduler, Worker
from distributed.dashboard.components.nvml import GPUCurrentLoad
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpulab.spawner.names import (
    GPU_ENFORCEMENT_ENV,
    GPU_FRACTION_ENV,
    GPU_MEMORY_LIMIT_MIB_ENV,
    GPU_UUIDS_ENV,
    MONITOR_SOURCE_ENV,
    PROFILE_ENV,
    PUSH_INTERVAL_ENV,
    REPORT_NAME_ENV,
    REPORT_TOKEN_ENV,
    REPORT_URL_ENV,
    REPORT_USER_ENV,
)
from jupyterlab_gpulab.dask_preload import MIB, share_figures
from jupyterlab_gpulab.sampler import Sample
from jupyterlab_gpulab.share import share_from_env
from jupyterlab_gpulab.sources import DeviceInfo, DeviceSample, SimulatedSource

QUARTER_UUID = "GPU-6f0b7c1e-aaaa-bbbb-cccc-000000000001"
QUARTER = {
    GPU_UUIDS_ENV: QUARTER_UUID,
    GPU_FRACTION_ENV: "0.250",
    GPU_MEMORY_LIMIT_MIB_ENV: "20389",
    GPU_ENFORCEMENT_ENV: "framework-caps",
    PROFILE_ENV: "1/4 GPU",
    MONITOR_SOURCE_ENV: "simulated",
}


def test_share_figures_sum_memory_and_average_utilization():
    devices = [
        DeviceInfo("a", "H100", 0, False, False, 81559.0, 20389.0),
        DeviceInfo("b", "H100", 1, False, False, 81559.0, 20389.0),
    ]
    sample = Sample.build(
        0.0,
        {
            "a": DeviceSample(50.0, 1000.0, 20389.0),
            "b": DeviceSample(None, 500.0, 20389.0),
        },
    )
    assert share_figures(sample, devices) == {
        "gpu_utilization": 25.0,
        "gpu_memory_used": 1500 * MIB,
        "gpu-memory-total": 2 * 20389 * MIB,
    }
    assert share_figures(None, devices) is None
    assert share_figures(sample, []) is None


async def _worker_metrics(scheduler: Scheduler, key: str) -> dict:
    for _ in range(200):
        states = list(scheduler.workers.values())
        if states and key in states[0].metrics:
            return dict(states[0].metrics)
        await asyncio.sleep(0.1)
    raise AssertionError(f"no worker reported {key!r} within 20 s: {scheduler.workers}")


async def test_dashboard_gpu_pane_shows_the_workers_share(monkeypatch):
    for name, value in QUARTER.items():
        monkeypatch.setenv(name, value)
    device = SimulatedSource(share_from_env()).devices()[0]
    assert device.memory_total_mib > device.memory_limit_mib == 20389  # a fraction of the card
    async with (
        Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler,
        Worker(
            scheduler.address,
            nthreads=1,
            preload=["jupyterlab_gpulab.dask_preload"],
            heartbeat_interval="100ms",
        ) as worker,
    ):
        metrics = await _worker_metrics(scheduler, "gpu_memory_used")
        assert metrics["gpu-memory-total"] == 20389 * MIB  # the share's, not the card's
        assert 0 <= metrics["gpu_memory_used"] <= 20389 * MIB
        assert 0 <= metrics["gpu_utilization"] <= 100
        assert "(1/4 GPU)" in worker.monitor.gpu_name
        assert (await worker.metrics["gpu"](worker)).keys() == {"utilization", "memory-used"}
        pane = GPUCurrentLoad(scheduler)
        pane.update()
        assert pane.memory_figure.title.text.endswith("/ 19.91 GiB")
    assert not worker._gpulab_share_monitor.sampler.running  # dask_teardown stopped it


async def test_worker_without_a_gpu_share_reports_no_gpu(monkeypatch):
    monkeypatch.setenv(GPU_ENFORCEMENT_ENV, "cpu-only")
    monkeypatch.setenv(MONITOR_SOURCE_ENV, "simulated")
    monkeypatch.delenv(GPU_UUIDS_ENV, raising=False)
    async with (
        Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler,
        Worker(
            scheduler.address,
            nthreads=1,
            preload=["jupyterlab_gpulab.dask_preload"],
            heartbeat_interval="100ms",
        ) as worker,
    ):
        metrics = await _worker_metrics(scheduler, "cpu")
        assert "gpu_memory_used" not in metrics and "gpu" not in worker.metrics
        assert worker.monitor.gpu_name is None


class _Pushes(web.RequestHandler):
    """A push endpoint that records what reaches it (gpulab-metrics' own checks are tested
    in the hub's tests; here: what the worker sends, and when)."""

    def initialize(self, received: list) -> None:
        self.received = received

    def post(self, path: str) -> None:
        self.received.append(
            (path, self.request.headers.get("Authorization"), self.request.body.decode())
        )


async def test_a_workers_gpu_report_is_pushed_from_its_loop_and_once_more_at_teardown(monkeypatch):
    received: list = []
    sockets = bind_sockets(0, "127.0.0.1")
    server = HTTPServer(web.Application([(r"/api/push/(.*)", _Pushes, {"received": received})]))
    server.add_sockets(sockets)
    port = sockets[0].getsockname()[1]
    for name, value in {
        **QUARTER,
        REPORT_URL_ENV: f"http://127.0.0.1:{port}/api/push",
        REPORT_TOKEN_ENV: "report-token-of-w3",
        REPORT_NAME_ENV: "dask-7-w3",
        REPORT_USER_ENV: "alice",
        PUSH_INTERVAL_ENV: "0.5",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        async with (
            Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler,
            Worker(scheduler.address, nthreads=1, preload=["jupyterlab_gpulab.dask_preload"]) as w,
        ):
            # read once, then gone from the environment the worker's tasks and their
            # subprocesses see
            assert REPORT_TOKEN_ENV not in os.environ
            for _ in range(100):
                if received:
                    break
                await asyncio.sleep(0.1)
            path, authorization, body = received[0]
            assert path == "alice/dask-7-w3" and authorization == "token report-token-of-w3"
            assert "dask-7-w3" in body and QUARTER_UUID in body  # the share's figures
            # labelled as simulated figures, as the monitor's source is
            assert 'gpulab_monitor_simulated{gpu="",server="dask-7-w3",user="alice"} 1.0' in body
            pushed_before_close = len(received)
        assert len(received) > pushed_before_close  # dask_teardown pushed the last stretch
        assert w._gpulab_reporter is None
    finally:
        server.stop()


async def test_a_worker_without_a_gpu_share_reports_nothing_and_drops_the_token(monkeypatch):
    monkeypatch.setenv(GPU_ENFORCEMENT_ENV, "cpu-only")
    monkeypatch.setenv(MONITOR_SOURCE_ENV, "simulated")
    monkeypatch.delenv(GPU_UUIDS_ENV, raising=False)
    monkeypatch.setenv(REPORT_URL_ENV, "http://127.0.0.1:9/api/push")  # nothing listens
    monkeypatch.setenv(REPORT_TOKEN_ENV, "report-token-of-w1")
    monkeypatch.setenv(REPORT_NAME_ENV, "dask-7-w1")
    monkeypatch.setenv(REPORT_USER_ENV, "alice")
    async with (
        Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler,
        Worker(scheduler.address, nthreads=1, preload=["jupyterlab_gpulab.dask_preload"]) as w,
    ):
        assert w._gpulab_reporter is None
        assert REPORT_TOKEN_ENV not in os.environ
