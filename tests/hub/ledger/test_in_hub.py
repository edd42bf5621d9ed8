"""The GPU-hour ledger in a real hub: real servers' grants and releases become intervals, their
monitors' pushes become used GPU-hours, budgets refuse a launch, and each user reads her own."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from traitlets.config import Config

from tests.harness.hub import Hub
from tests.harness.ports import free_port
from tests.harness.wait import wait_for


@pytest.fixture
def ledger_hub(make_hub: Any, tmp_path: Path, shared_dir: Path) -> Hub:
    figures = shared_dir / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 60}}))  # busy simulated GPUs
    config = tmp_path / "metrics_config.py"
    config.write_text("c.MetricsService.listing_interval_seconds = 1\n")
    overlay = Config()
    overlay.GPUCapacity.declared_inventory = "2 x A100-SXM4-80GB"
    overlay.Spawner.environment.update(
        {"GPULAB_MONITOR_SOURCE": "simulated", "GPULAB_SIMULATED_GPU_FILE": str(figures)}
    )
    overlay.GPULedger.reconcile_interval_seconds = 1
    overlay.GPULedger.budget_check_interval_seconds = 1
    # about 4 s of a whole GPU: bob's budget runs out within the test
    overlay.GPULedger.hour_quota_users = {"bob": "1/900"}
    overlay.JupyterHub.authenticate_prometheus = False
    return make_hub(
        overlay,
        env={
            "GPULAB_METRICS_SERVICE_PORT": str(free_port()),
            "GPULAB_METRICS_CONFIG": str(config),
            "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "1",
        },
    )


def usage(hub: Hub, **params: str) -> dict[str, Any]:
    r = hub.api("GET", "/gpulab/usage", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_grants_and_releases_are_intervals_and_pushes_are_used_hours(ledger_hub: Hub) -> None:
    hub = ledger_hub
    hub.create_user("alice", groups=("ml",))
    before = time.time()
    hub.start_server("alice", profile="gpu-quarter")
    started = time.time()
    # the server's monitor pushes (60 % busy) until some used GPU-time is recorded
    wait_for(
        "used GPU-hours from alice's pushes",
        lambda: usage(hub, bucket="hour")["totals"]["used_gpu_hours"] > 0 or None,
        90,
        1,
    )
    stopping = time.time()
    hub.stop_server("alice")
    stopped = time.time()

    body = usage(hub, bucket="day", by="user,group,profile,workload,gpu_model,tier")
    (row,) = body["rows"]
    assert {k: row[k] for k in ("user", "group", "profile", "workload", "gpu_model", "tier")} == {
        "user": "alice",
        "group": "ml",
        "profile": "gpu-quarter",
        "workload": "server",
        "gpu_model": "A100-SXM4-80GB",
        "tier": "on-demand",
    }
    # a quarter of a GPU, from the grant (during the start) to the release (during the stop),
    # in whole seconds
    seconds = row["allocated_gpu_hours"] * 3600 / 0.25
    assert abs(seconds - round(seconds)) < 1e-6
    assert (stopping - started) - 1 <= seconds <= (stopped - before) + 1
    assert 0 < row["used_gpu_hours"] <= row["allocated_gpu_hours"]
    assert row["idle_gpu_hours"] == pytest.approx(
        row["allocated_gpu_hours"] - row["used_gpu_hours"]
    )
    assert row["unmonitored_gpu_hours"] == 0.0  # a server: its monitor measured it

    r = hub.api("GET", "/gpulab/usage", params={"by": "profile", "format": "csv"})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/csv")
    header, line = r.text.splitlines()
    assert header == (
        "bucket,profile,allocated_gpu_hours,used_gpu_hours,idle_gpu_hours,unmonitored_gpu_hours"
    )
    assert line.split(",")[1] == "gpu-quarter"

    # the counters on the hub's /hub/metrics
    def allocated_counter() -> float | None:
        text = httpx.get(f"{hub.url}/hub/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "gpulab_gpu_hours_allocated_total" and s.labels["user"] == "alice":
                    return s.value if s.value == pytest.approx(row["allocated_gpu_hours"]) else None
        return None

    wait_for("alice's GPU-hours on /hub/metrics", allocated_counter, 30, 0.5)

    # the ledger is the hub's: private file, and no server is told where it is
    ledger_file = hub.state_dir / "gpulab-ledger.sqlite"
    assert stat.S_IMODE(os.stat(ledger_file).st_mode) == 0o600


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"bucket": "week"}, "bucket"),
        ({"by": "colour"}, "by"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-12-02", "until": "2026-12-01"}, "until"),
        ({"format": "xml"}, "format"),
        ({"bucket": "hour", "since": "2000-01-01"}, "since..until"),
    ],
)
def test_bad_usage_queries_name_the_field(ledger_hub: Hub, params: dict, field: str) -> None:
    r = ledger_hub.api("GET", "/gpulab/usage", params=params)
    assert r.status_code == 400
    assert field in r.json()["message"]


def test_a_user_reads_her_own_gpu_hours_only_and_a_spent_budget_refuses_a_launch(
    ledger_hub: Hub,
) -> None:
    hub = ledger_hub
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("bob", profile="gpu-1")
    assert "GPULAB_LEDGER_DB_URL" not in hub.server_env("bob")

    def bob_token() -> str:
        r = hub.api("POST", "/users/bob/tokens", json={"note": "test", "expires_in": 600})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    bob = httpx.Client(
        base_url=f"{hub.url}/hub/api", headers={"Authorization": f"token {bob_token()}"}
    )
    r = bob.get("/gpulab/users/bob/usage")
    assert r.status_code == 200, r.text
    assert r.json()["budgets"][0]["scope"] == "user" and r.json()["user"] == "bob"
    assert bob.get("/gpulab/users/alice/usage").status_code == 404  # JupyterHub's filtered answer
    assert bob.get("/gpulab/usage").status_code == 403

    # bob's budget (1/900 GPU-hour = 4 s of a GPU) runs out while his server runs
    def exhausted() -> bool | None:
        budgets = bob.get("/gpulab/users/bob/usage").json()["budgets"]
        return budgets[0]["state"] == "exhausted" or None

    wait_for("bob's budget to run out", exhausted, 60, 0.5)
    hub.stop_server("bob")
    r = hub.spawn("bob", profile="gpu-quarter")
    assert r.status_code == 403, r.text
    assert "GPU-hour budget used up" in r.json()["message"]
    assert "bob:" in r.json()["message"] and "GPU-hours allocated" in r.json()["message"]
    # CPU needs no GPU-hours, and alice has no budget to spend
    hub.start_server("alice", profile="gpu-quarter")
    assert not any(a["owner"] == "bob" for a in hub.allocations().values())


def test_the_admin_overview_shows_each_slices_pushed_figures_and_gpu_idle_time(
    ledger_hub: Hub, shared_dir: Path
) -> None:
    hub = ledger_hub
    hub.create_user("alice")
    hub.start_server("alice", profile="gpu-quarter")

    def alice_row() -> dict[str, Any] | None:
        r = hub.api("GET", "/gpulab/admin/overview")
        assert r.status_code == 200, hub.log()[-3000:]
        rows = [w for w in r.json()["workloads"] if w["owner"] == "alice"]
        return rows[0] if rows and rows[0]["live"] is not None else None

    busy = wait_for("alice's pushed figures in the overview", alice_row, 60, 0.5)
    assert busy["utilization"] == 60 and busy["gpu_idle_seconds"] == 0
    assert busy["memory_used_mib"] is not None
    assert (
        busy["live"]["age_seconds"] <= 15
    )  # at most one push interval (1 s here) old, and then some
    # the GPU goes quiet: the panel counts GPU-idle time from the first quiet push
    (shared_dir / "gpus.json").write_text(json.dumps({"*": {"utilization_pct": 0}}))

    def idle_for_a_while() -> dict[str, Any] | None:
        row = alice_row()
        return row if row and row["utilization"] == 0 and row["gpu_idle_seconds"] >= 2 else None

    idle = wait_for("alice's GPU-idle time", idle_for_a_while, 60, 0.5)
    (slice_,) = idle["live"]["slices"]
    assert slice_["below_threshold_since"] is not None
    hub.stop_server("alice")
    # a stopped server's figures leave the live table
    wait_for(
        "alice's figures gone",
        lambda: (
            not any(
                w["owner"] == "alice"
                for w in hub.api("GET", "/gpulab/admin/overview").json()["workloads"]
            )
            or None
        ),
        30,
        0.5,
    )


def test_a_group_budget_used_up_during_a_session_stops_the_members_gpu_server(
    make_hub: Any,
) -> None:
    overlay = Config()
    overlay.GPUCapacity.declared_inventory = "2 x A100-SXM4-80GB"
    overlay.GPULedger.reconcile_interval_seconds = 1
    overlay.GPULedger.budget_check_interval_seconds = 1
    overlay.GPULedger.hour_quota_groups = {"course": "1/900"}  # 4 s of a whole GPU
    overlay.GPULedger.stop_when_exhausted = True
    hub = make_hub(overlay, env={"GPULAB_METRICS_SERVICE": "0"})
    hub.create_user("carol", groups=("course",))
    hub.create_user("dave")
    hub.start_server("dave", profile="gpu-1")  # no budget binds dave: his server runs on
    hub.start_server("carol", profile="gpu-1")
    wait_for(
        "carol's server stopped for her group's budget",
        lambda: hub.server_model("carol") is None or None,
        60,
        0.5,
    )
    assert [a["owner"] for a in hub.allocations().values()] == ["dave"]
    assert hub.server_model("dave") is not None
    # she reads why the next time she opens the picker (seen here through an admin session)
    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/spawn/carol").text
    assert "GPU-hour budget used up: group course:" in page
    # and a new GPU start is refused, naming the budget
    r = hub.spawn("carol", profile="gpu-quarter")
    assert r.status_code == 403 and "group course" in r.json()["message"]
    (interval,) = [i for i in hub.ledger_intervals() if i.holding.user == "carol"]
    assert interval.end_reason == "budget" and interval.holding.groups == ("course",)
