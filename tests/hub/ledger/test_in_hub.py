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

from tests.harness.hub import Hub, fast_metrics_env
from tests.harness.wait import WaitTimeout, wait_for


@pytest.fixture
def ledger_hub(make_hub: Any, tmp_path: Path, shared_dir: Path) -> Hub:
    figures = shared_dir / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 60}}))  # busy simulated GPUs
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
        env=fast_metrics_env(tmp_path),
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

    # the counters on the hub's /hub/metrics: the collector's figures are refreshed by the ledger's
    # loop (every second here), so they are compared with the ledger's answer read at the same time
    def counter_and_usage() -> tuple[float | None, float]:
        text = httpx.get(f"{hub.url}/hub/metrics", timeout=30).text
        counter = None
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "gpulab_gpu_hours_allocated_total" and s.labels["user"] == "alice":
                    counter = s.value
        (now_row,) = usage(hub, bucket="day")["rows"]
        return counter, now_row["allocated_gpu_hours"]

    seen: list[tuple[float | None, float]] = []

    def counter_matches() -> bool:
        seen.append(counter_and_usage())
        counter, allocated = seen[-1]
        return counter is not None and counter == pytest.approx(allocated)

    try:
        wait_for(
            "alice's GPU-hours on /hub/metrics equal to /gpulab/usage's", counter_matches, 60, 0.5
        )
    except WaitTimeout as e:
        raise AssertionError(f"{e}; last (counter, usage) pairs: {seen[-3:]}") from None
    # the interval ended with the stop: the ledger's answer did not change since
    assert seen[-1][1] == pytest.approx(row["allocated_gpu_hours"]), seen[-3:]

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


def test_a_job_run_reports_its_gpu_use_with_a_token_worth_only_that_run(ledger_hub: Hub) -> None:
    """A job run has no lab and no server token: its wrapper pushes its share's figures with the
    report token the hub issued it, so its hours are used or idle, not unmonitored. The token is
    in the wrapper's private spec only (not the job's environment), reaches nothing but that
    run's report, another user's token cannot report for the run, and it dies with the share."""
    from tests.harness.jobs import put, until, user_client

    hub = ledger_hub
    hub.create_user("alice")
    hub.create_user("mallory")
    hub.start_server("alice", profile="cpu")  # her account and home
    put(
        hub,
        "alice",
        "train.py",
        "import os, time\n"
        "print('report token in my environment:', any('REPORT' in k for k in os.environ))\n"
        "time.sleep(8)\n",
    )
    alice = user_client(hub, "alice")
    body = {"name": "train", "kind": "script", "path": "train.py", "profile": "gpu-quarter"}
    r = alice.post("/users/alice/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    until(alice, f"/users/alice/jobs/{run_id}", "running", "succeeded", "failed")

    # the wrapper's spec (root's, handed over on a descriptor) holds the run's report
    (spec_file,) = hub.state_dir.glob(f"job-runs/run-{run_id}/attempt-1/spec.json")
    report = json.loads(spec_file.read_text())["gpu_report"]
    assert report["GPULAB_REPORT_NAME"] == f"job-{run_id}"
    assert report["GPULAB_REPORT_USER"] == "alice"
    token = report["GPULAB_REPORT_TOKEN"]
    push_base = report["GPULAB_REPORT_URL"]

    def push(user: str, name: str, with_token: str) -> httpx.Response:
        return httpx.post(
            f"{push_base}/{user}/{name}",
            content=b'gpulab_gpu_utilization_ratio{gpu="x"} 0.5\n',
            headers={"Authorization": f"token {with_token}"},
            timeout=30,
        )

    # worth that run's report only: no hub API, not her server, not another run of hers
    as_run = httpx.Client(
        base_url=f"{hub.url}/hub/api", headers={"Authorization": f"token {token}"}, timeout=30
    )
    # (JupyterHub tells any token whose it is: its owner's name and nothing more)
    assert "servers" not in as_run.get("/users/alice").json()
    assert as_run.get("/users/alice/tokens").status_code == 403
    assert as_run.post("/users/alice/server").status_code == 403
    assert as_run.get(f"/gpulab/users/alice/jobs/{run_id}").status_code == 403
    assert push("alice", "", token).status_code == 403
    assert push("alice", f"job-{run_id + 1}", token).status_code == 403
    # another tenant's token cannot report for alice's run, nor can alice's own user token
    mallory = hub.api("POST", "/users/mallory/tokens", json={"note": "t"}).json()["token"]
    refused = push("alice", f"job-{run_id}", mallory)
    assert refused.status_code == 403 and "mallory" in refused.json()["message"]
    own = hub.api("POST", "/users/alice/tokens", json={"note": "t", "scopes": ["read:users!user"]})
    assert push("alice", f"job-{run_id}", own.json()["token"]).status_code == 403

    # the admin panel's live columns for the run, from its own report
    def live_job() -> dict[str, Any] | None:
        r = hub.api("GET", "/gpulab/admin/overview", params={"kind": "job"})
        rows = [w for w in r.json()["workloads"] if w["id"] == f"alice/job-{run_id}"]
        return rows[0] if rows and rows[0]["utilization"] is not None else None

    job = wait_for("the run's live GPU figures in the admin overview", live_job, 30, 0.3)
    assert job["monitored"] is True and job["utilization"] == pytest.approx(60)

    done = until(alice, f"/users/alice/jobs/{run_id}", "succeeded", "failed", timeout=90)
    assert done["state"] == "succeeded", (done, hub.log()[-3000:])
    logs = alice.get(f"/users/alice/jobs/{run_id}/logs").json()["data"]
    assert "report token in my environment: False" in logs, logs

    # its hours: measured (60 % busy simulated GPU), not unmonitored
    def job_row() -> dict[str, Any] | None:
        rows = [
            r
            for r in usage(hub, by="workload", bucket="day")["rows"]
            if r["workload"] == "job" and r["used_gpu_hours"] > 0
        ]
        return rows[0] if rows else None

    row = wait_for("the run's used GPU-hours", job_row, 30, 0.5)
    assert row["unmonitored_gpu_hours"] == 0.0
    assert 0 < row["used_gpu_hours"] <= row["allocated_gpu_hours"]
    assert row["idle_gpu_hours"] == pytest.approx(
        row["allocated_gpu_hours"] - row["used_gpu_hours"]
    )
    # the share is given back: the token is gone from alice's tokens, and refused
    wait_for(
        "the run's report token revoked",
        lambda: (
            not [
                t
                for t in hub.api("GET", "/users/alice/tokens").json()["api_tokens"]
                if t["note"].startswith("gpulab GPU report for ")
            ]
            or None
        ),
        30,
        0.5,
    )
    # refused once gpulab-metrics' next listing no longer has the run (its cached answer about
    # the token may be up to a minute old; the run's being gone is not)
    wait_for(
        "a push with the revoked token refused",
        lambda: push("alice", f"job-{run_id}", token).status_code == 403 or None,
        30,
        0.5,
    )
