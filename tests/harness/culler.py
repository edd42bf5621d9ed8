"""Helpers of the GPU-aware culling tests through a real hub: a hub whose culler works in seconds,
its decisions as the admin API gives them, and a user's server's culling endpoints."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect
from traitlets.config import Config

from tests.harness.hub import Hub, fast_metrics_env

#: seconds: T (no UI input), T_gpu (GPU below U), W (warning), the check and report cadence
UI_IDLE_SECONDS = 15
GPU_IDLE_SECONDS = 2
WARN_SECONDS = 4
CHECK_INTERVAL_SECONDS = 1.0


def culling_policy(
    dry_run: bool = False,
    action: str = "stop",
    ui_idle_seconds: int = UI_IDLE_SECONDS,
    warn_seconds: int = WARN_SECONDS,
) -> dict[str, Any]:
    return {
        "dry_run": dry_run,
        "stale_sample_seconds": 10,
        "default": {
            "ui_idle_seconds": ui_idle_seconds,
            "gpu_idle_seconds": GPU_IDLE_SECONDS,
            "warn_seconds": warn_seconds,
            "keep_alive_seconds": 600,
            "action": action,
        },
    }


def make_culling_hub(
    make_hub: Any,
    tmp_path: Path,
    figures_dir: Path,
    policy: dict[str, Any],
    inventory: str = "2 x A100-SXM4-80GB",
    start: bool = True,
    extra: Config | None = None,
) -> Hub:
    """A hub with simulated GPUs at 0 % (figures_dir/gpus.json; rewrite it to change them), its
    servers pushing GPU figures and activity every second, and the culler checking every
    second with `policy` (seconds-long rules: GPUCuller.min_idle_seconds = 1)."""
    figures = figures_dir / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 0}}))
    overlay = Config()
    overlay.GPUCapacity.declared_inventory = inventory
    overlay.GPUJobs.admission_interval_seconds = 0.5
    overlay.Spawner.environment.update(
        {"GPULAB_MONITOR_SOURCE": "simulated", "GPULAB_SIMULATED_GPU_FILE": str(figures)}
    )
    overlay.GPUCuller.policy = policy
    overlay.GPUCuller.check_interval_seconds = CHECK_INTERVAL_SECONDS
    overlay.GPUCuller.report_interval_seconds = 1.0
    overlay.GPUCuller.min_idle_seconds = 1
    overlay.JupyterHub.authenticate_prometheus = False
    if extra is not None:
        overlay.merge(extra)
    return make_hub(
        overlay,
        start=start,
        env=fast_metrics_env(tmp_path),
    )


def culling(hub: Hub) -> dict[str, Any]:
    """GET /hub/api/gpulab/admin/culling."""
    r = hub.api("GET", "/gpulab/admin/culling")
    assert r.status_code == 200, r.text
    return dict(r.json())


def decision_of(hub: Hub, user: str, server: str = "") -> dict[str, Any] | None:
    """The latest decision on `user`'s server (None: not judged, or no longer running)."""
    for d in culling(hub)["decisions"]:
        if d["user"] == user and d["server"] == server:
            return dict(d)
    return None


def lab(hub: Hub, user: str) -> httpx.Client:
    """A client of `user`'s default server through the proxy (the hub's admin service token)."""
    return httpx.Client(
        base_url=f"{hub.url}/user/{user}/",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )


#: the culling matrix's servers: each exempt one for its own reason, and two the culler must end
MATRIX_EXEMPT = ("busy", "jobber", "dasker", "keeper", "typist")
MATRIX_CULLED = ("panel", "idle")
MATRIX_PROFILE = "gpu-eighth"


#: the cell that gives "dasker" active Dask work: a cluster of one worker, a ten-minute task that
#: runs on after the cell's kernel is gone (fire_and_forget: run_in_kernel's kernel is deleted
#: when the cell is done, and its client's futures with it)
DASK_WORK = """
import time
from distributed import Client, fire_and_forget
from gpulab.dask import GPUCluster
cluster = GPUCluster(profile="{profile}", n_workers=1, name="work")
client = Client(cluster)
client.wait_for_workers(1, timeout=180)
task = client.submit(time.sleep, 600, pure=False)
fire_and_forget(task)
print("SUBMITTED", task.key)
"""


@dataclass
class MatrixOutcome:
    """What the culling matrix saw: exempt servers culled (false culls), the latest decision on
    each exempt server, when each server was first warned, each cull decision and its delay after
    the warning (seconds)."""

    false_culls: list[str]
    exempt_decisions: dict[str, dict[str, Any]]
    warned_at: dict[str, float]
    culls: dict[str, dict[str, Any]]
    delays: dict[str, float] = field(default_factory=dict)


def _running(hub: Hub, user: str) -> bool:
    return hub.server_model(user) is not None


def _culled(hub: Hub, user: str) -> bool:
    """The culler decided to cull `user`'s server (it may still be stopping)."""
    return any(d["user"] == user and d["verdict"] == "cull" for d in culling(hub)["recent_actions"])


async def run_culling_matrix(hub: Hub, ui_idle_seconds: float) -> MatrixOutcome:
    """Seven real servers on `hub` (make_culling_hub's, with T = `ui_idle_seconds`): a kernel busy
    all along (busy), a job run of the owner's all along (jobber), a Dask cluster made from the
    server with a task running all along (dasker), "Keep alive" clicked (keeper),
    real keys reported every half second (typist), only the GPU panel open and polling (panel),
    and nothing (idle). Runs until both culled-to-be servers are gone, at least T + W + 10 s
    after the last start, and says what happened (no assertion beyond the harness's own)."""
    from tests.harness.hub import run_in_kernel
    from tests.harness.jobs import put, until, user_client
    from tests.harness.wait import wait_for_async

    profile = MATRIX_PROFILE
    for user in (*MATRIX_EXEMPT, *MATRIX_CULLED):
        hub.create_user(user)
    # one server at a time, each exemption in place as soon as its server is up

    # a cell that runs all along, in a real kernel
    hub.start_server("busy", profile=profile)
    busy_cell = asyncio.ensure_future(
        run_in_kernel(hub, "busy", "import time\ntime.sleep(600)", timeout=600)
    )

    async def kernel_busy() -> bool:
        d = decision_of(hub, "busy")
        return bool(d and "busy-kernels" in d["causes"])

    await wait_for_async("busy's kernel counted busy", kernel_busy, 60, 0.5)

    # a job run of the owner's, running all along
    hub.start_server("jobber", profile=profile)
    put(hub, "jobber", "sleep.py", "import time\ntime.sleep(600)\n")
    jobber = user_client(hub, "jobber")
    r = jobber.post(
        "/users/jobber/jobs",
        json={"name": "long", "kind": "script", "path": "sleep.py", "profile": profile},
    )
    assert r.status_code == 201, r.text
    until(jobber, f"/users/jobber/jobs/{r.json()['id']}", "running")

    # a Dask cluster made from the server's kernel, a task running on it all along (the kernel
    # itself goes idle once the cell has submitted it)
    hub.start_server("dasker", profile=profile)
    submitted = await run_in_kernel(hub, "dasker", DASK_WORK.format(profile=profile), timeout=300)
    assert "SUBMITTED" in submitted, submitted

    async def dask_busy() -> bool:
        d = decision_of(hub, "dasker")
        return bool(d and "dask-work" in d["causes"])

    await wait_for_async("dasker's Dask task counted", dask_busy, 60, 0.5)

    # "Keep alive" clicked once
    hub.start_server("keeper", profile=profile)
    r = lab(hub, "keeper").post("gpulab/culling/keep-alive")
    assert r.status_code == 200, r.text

    # somebody typing: what the lab's frontend reports of her keys, every half second
    hub.start_server("typist", profile=profile)
    typing = threading.Event()

    def type_along() -> None:
        with lab(hub, "typist") as typist:
            while not typing.wait(0.5):
                r = typist.post("gpulab/culling/input", json={"kind": "ui-input"})
                assert r.status_code == 204, r.text

    typist_thread = threading.Thread(target=type_along, daemon=True)
    typist_thread.start()

    hub.start_server("panel", profile=profile)
    hub.start_server("idle", profile=profile)
    panel = lab(hub, "panel")
    ws = await websocket_connect(
        HTTPRequest(
            hub.url.replace("http://", "ws://") + "/user/panel/gpulab/monitor/ws?rate_hz=2",
            headers={"Authorization": f"token {hub.token}"},
        )
    )
    assert json.loads(await ws.read_message())["type"] == "hello"

    warned_at: dict[str, float] = {}
    false_culls: set[str] = set()
    panel_open = True
    try:
        # long enough for every server to be culled were it idle: T + W + a few checks after the
        # last start, with typist typing and panel's GPU panel open and polled all along
        deadline = time.monotonic() + ui_idle_seconds + WARN_SECONDS + 10
        while time.monotonic() < deadline or not all(not _running(hub, u) for u in MATRIX_CULLED):
            if time.monotonic() > deadline + 30:
                break  # a missed cull: the caller sees it in `culls`
            assert typist_thread.is_alive()
            if panel_open:  # what an open GPU panel does: samples on its socket, polls
                message = await asyncio.wait_for(ws.read_message(), 5)
                samples = panel.get("gpulab/monitor/samples").status_code
                state = panel.get("gpulab/culling").status_code
                panel_open = message is not None and samples == state == 200
                assert panel_open or _culled(hub, "panel"), (message, samples, state)
            for d in culling(hub)["decisions"]:
                if d["verdict"] in ("warn", "wait") and d["user"] not in warned_at:
                    warned_at[d["user"]] = d["deadline"] - WARN_SECONDS
            false_culls |= {u for u in MATRIX_EXEMPT if not _running(hub, u)}
            await asyncio.sleep(0.5)
    finally:
        ws.close()
        busy_cell.cancel()
        typing.set()

    exempt = {u: decision_of(hub, u) or {} for u in MATRIX_EXEMPT}
    culls = {d["user"]: d for d in culling(hub)["recent_actions"] if d["verdict"] == "cull"}
    false_culls |= set(culls) & set(MATRIX_EXEMPT)
    delays = {u: c["at"] - (c["deadline"] - WARN_SECONDS) for u, c in culls.items()}
    return MatrixOutcome(sorted(false_culls), exempt, warned_at, culls, delays)
