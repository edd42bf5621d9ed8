"""Helpers of the GPU-aware culling tests through a real hub: a hub whose culler works in seconds,
its decisions as the admin API gives them, and a user's server's culling endpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from tests.harness.hub import Hub
from tests.harness.ports import free_port

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
) -> Hub:
    """A hub with simulated GPUs at 0 % (figures_dir/gpus.json; rewrite it to change them), its
    servers pushing GPU figures and activity every second, and the culler checking every
    second with `policy` (seconds-long rules: GPUCuller.min_idle_seconds = 1)."""
    figures = figures_dir / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 0}}))
    config = tmp_path / "metrics_config.py"
    config.write_text("c.MetricsService.listing_interval_seconds = 1\n")
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
    return make_hub(
        overlay,
        start=start,
        env={
            "GPULAB_METRICS_SERVICE_PORT": str(free_port()),
            "GPULAB_METRICS_CONFIG": str(config),
            "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "1",
        },
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
