"""GPU-aware culling in a real hub: real servers report their input and kernels, gpulab-metrics
their simulated GPU figures (0 % unless a test changes them), and the hub's culler warns and culls
with rules of seconds (tests/harness/culler.py: T = 15 s (45 s in the matrix), T_gpu = 2 s,
W = 4 s, a check a second).

The matrix: no exempt server is ever culled (a busy kernel, a running job, active Dask work,
real UI input, a keep-alive click), while an idle one and one with only its GPU panel open are."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from traitlets.config import Config

from tests.harness.culler import (
    CHECK_INTERVAL_SECONDS,
    MATRIX_CULLED,
    MATRIX_EXEMPT,
    UI_IDLE_SECONDS,
    WARN_SECONDS,
    culling,
    culling_policy,
    decision_of,
    lab,
    make_culling_hub,
    run_culling_matrix,
)
from tests.harness.hub import Hub
from tests.harness.wait import wait_for

PROFILE = "gpu-eighth"
#: T of the matrix: six servers, a job and a kernel take this long to start on a small machine,
#: and no exemption may come too late for it
MATRIX_UI_IDLE_SECONDS = 30


def _running(hub: Hub, user: str) -> bool:
    return hub.server_model(user) is not None


async def test_only_idle_servers_are_culled_and_never_an_exempt_one(
    make_hub: Any, tmp_path: Path, shared_dir: Path
) -> None:
    policy = culling_policy(dry_run=False, ui_idle_seconds=MATRIX_UI_IDLE_SECONDS)
    hub = make_culling_hub(make_hub, tmp_path, shared_dir, policy)
    outcome = await run_culling_matrix(hub, MATRIX_UI_IDLE_SECONDS)

    assert outcome.false_culls == [], hub.log()[-4000:]
    exempt = outcome.exempt_decisions
    assert exempt["busy"]["verdict"] == "exempt" and "busy-kernels" in exempt["busy"]["causes"]
    assert exempt["jobber"]["verdict"] == "exempt"
    assert "running-jobs" in exempt["jobber"]["causes"]
    assert exempt["dasker"]["verdict"] == "exempt" and "dask-work" in exempt["dasker"]["causes"]
    assert exempt["keeper"]["verdict"] == "exempt" and exempt["keeper"]["causes"][0] == "keep-alive"
    assert exempt["typist"]["verdict"] == "keep" and exempt["typist"]["causes"] == ["ui-input"]
    assert set(MATRIX_CULLED) <= set(outcome.warned_at)
    assert not set(MATRIX_EXEMPT) & set(outcome.warned_at)

    # each cull came W to W + one check interval after its warning (decisions on a 1 s grid)
    assert set(outcome.culls) == set(MATRIX_CULLED), outcome.culls
    for user, cull in outcome.culls.items():
        assert cull["effect"] == "stop" and cull["dry_run"] is False
        assert "no UI input for" in cull["reason"] and "below 5%" in cull["reason"]
        delay = outcome.delays[user]
        print(f"{user}: culled {delay:.2f} s after the warning")
        assert WARN_SECONDS <= delay <= WARN_SECONDS + CHECK_INTERVAL_SECONDS + 1e-6
    # their GPU shares are free again, the job's and the others' are held
    owners = {a["owner"] for a in hub.allocations().values()}
    assert owners == set(MATRIX_EXEMPT)
    # and the ledger says why theirs ended
    reasons = {i.holding.user: i.end_reason for i in hub.ledger_intervals() if not i.open}
    assert {reasons.get(u) for u in MATRIX_CULLED} == {"culled"}


def test_a_dry_run_culls_nothing_and_reports_what_it_would_cull(
    make_hub: Any, tmp_path: Path, shared_dir: Path
) -> None:
    hub = make_culling_hub(make_hub, tmp_path, shared_dir, culling_policy(dry_run=True))
    hub.create_user("idle")
    hub.start_server("idle", profile="gpu-quarter")

    def would_cull() -> dict[str, Any] | None:
        d = decision_of(hub, "idle")
        return d if d and d["verdict"] == "cull" else None

    decision = wait_for("a dry-run cull decision", would_cull, UI_IDLE_SECONDS + WARN_SECONDS + 30)
    assert decision["effect"] == "none" and decision["dry_run"] is True
    assert _running(hub, "idle")
    body = culling(hub)
    assert body["dry_run"] is True
    assert body["summary"]["text"].startswith("would cull 1 server, reclaim 6 GPU-h/day")
    assert body["summary"]["would_cull"] == 1
    assert body["summary"]["reclaim_gpu_hours_per_day"] == 6  # 1/4 GPU x 24 h
    assert body["recent_actions"] == []  # nothing warned, nothing stopped
    # the admin panel's row says the same
    (row,) = [w for w in hub.api("GET", "/gpulab/admin/overview").json()["workloads"]]
    assert row["culling"]["verdict"] == "cull" and row["culling"]["dry_run"] is True
    assert row["culling"]["reason"] == decision["reason"] or "warned" in row["culling"]["reason"]
    # JupyterLab is shown no warning in a dry run
    state = lab(hub, "idle").get("gpulab/culling").json()
    assert state["warning"] is None and state["reporting"] is True
    # the counter on /hub/metrics, without user names
    text = httpx.get(f"{hub.url}/hub/metrics", timeout=30).text
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpulab_cull_decisions_total"
    ]
    culls = [s for s in samples if s.labels["verdict"] == "cull"]
    assert culls and all(s.labels["mode"] == "dry-run" for s in samples)
    assert culls[0].labels == {
        "verdict": "cull",
        "cause": "idle",
        "profile": "gpu-quarter",
        "mode": "dry-run",
    }
    assert all("user" not in s.labels for s in samples)
    time.sleep(2 * CHECK_INTERVAL_SECONDS)
    assert _running(hub, "idle")
    assert "would cull 1 server" in hub.log()


def test_a_policy_naming_a_profile_not_in_the_catalog_stops_the_hub(
    make_hub: Any, tmp_path: Path, shared_dir: Path
) -> None:
    policy = culling_policy()
    policy["profiles"] = {"gpu-ful": {"warn_seconds": 60}}
    hub = make_culling_hub(make_hub, tmp_path, shared_dir, policy, start=False)
    hub.start(expect_failure=True)
    assert hub.wait_exit() != 0
    assert "GPUCuller.policy.profiles.gpu-ful: no profile 'gpu-ful' in the catalog" in hub.log()


def test_a_server_moved_to_cpu_comes_back_on_the_cpu_profile(
    make_hub: Any, tmp_path: Path, shared_dir: Path
) -> None:
    hub = make_culling_hub(make_hub, tmp_path, shared_dir, culling_policy(action="downsize"))
    hub.create_user("idle")
    first = hub.start_server("idle", profile="gpu-quarter")

    def on_cpu() -> dict[str, Any] | None:
        model = hub.server_model("idle")
        if model and model.get("ready") and model["started"] != first["started"]:
            return model
        return None

    model = wait_for("idle's server back on CPU", on_cpu, UI_IDLE_SECONDS + WARN_SECONDS + 60)
    assert model["user_options"]["profile"] == "cpu"
    assert not any(a["owner"] == "idle" and a["gpus"] for a in hub.allocations().values())
    (cull,) = [d for d in culling(hub)["recent_actions"] if d["verdict"] == "cull"]
    assert cull["effect"] == "downsize" and "restart it on CPU only" in cull["reason"]


def test_a_servers_token_reports_for_its_owner_only(
    make_hub: Any, tmp_path: Path, shared_dir: Path
) -> None:
    hub = make_culling_hub(make_hub, tmp_path, shared_dir, culling_policy(dry_run=True))
    for user in ("alice", "bob"):
        hub.create_user(user)
        hub.start_server(user, profile=PROFILE)
    token = hub.server_env("bob")["JUPYTERHUB_API_TOKEN"]
    bob = httpx.Client(
        base_url=f"{hub.url}/hub/api/gpulab",
        headers={"Authorization": f"token {token}"},
        timeout=30,
    )
    # bob's server cannot keep alice's alive, nor move it
    r = bob.post("/users/alice/activity", json={"busy_kernels": 5, "keep_alive": True})
    assert r.status_code == 404, r.text  # JupyterHub's answer for a filter that does not match
    assert bob.post("/users/alice/switch-to-cpu").status_code == 404
    # for itself it may, and hears how often to report
    r = bob.post("/users/bob/activity", json={"busy_kernels": 1})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "culling": True,
        "report_interval_seconds": 1.0,
        "warning": None,
        "keep_alive_until": None,
        "budget_notice": None,  # no GPU-hour budget binds bob
    }
    r = bob.post("/users/bob/activity", json={"busy_kernels": -1})
    assert r.status_code == 400 and r.json()["message"].startswith("busy_kernels: expected a count")
    r = bob.post("/users/bob/servers/nope/activity", json={})
    assert r.status_code == 404 and "bob has no running server 'nope'" in r.json()["message"]
    # alice's own report was never replaced by bob's
    d = wait_for("a decision on alice", lambda: decision_of(hub, "alice"), 30, 0.5)
    assert "busy-kernels" not in d["causes"] and "keep-alive" not in d["causes"]


def test_jupyterlab_hears_of_her_gpu_hour_budget_past_its_warning_share_and_no_one_elses(
    make_hub: Any, tmp_path: Path, shared_dir: Path
) -> None:
    extra = Config()
    extra.GPULedger.hour_quota_users = {"alice": "1/900"}  # 4 s of a whole GPU
    extra.GPULedger.budget_check_interval_seconds = 1
    extra.GPULedger.reconcile_interval_seconds = 1
    hub = make_culling_hub(
        make_hub, tmp_path, shared_dir, culling_policy(dry_run=True), extra=extra
    )
    for user in ("alice", "bob"):
        hub.create_user(user)
        hub.start_server(user, profile="gpu-1")

    def notice() -> dict[str, Any] | None:
        state = lab(hub, "alice").get("gpulab/culling").json()
        return state["budget_notice"]

    seen = wait_for("alice's budget notice in her lab", notice, 60, 0.5)
    assert seen["state"] in ("warn", "exhausted")
    assert seen["message"].startswith("GPU-hour budget") and "alice:" in seen["message"]
    assert lab(hub, "bob").get("gpulab/culling").json()["budget_notice"] is None
