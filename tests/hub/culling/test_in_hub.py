"""GPU-aware culling in a real hub: real servers report their input and kernels, gpulab-metrics
their simulated GPU figures (0 % unless a test changes them), and the hub's culler warns and culls
with rules of seconds (tests/harness/culler.py: T = 15 s (45 s in the matrix), T_gpu = 2 s,
W = 4 s, a check a second).

The matrix: no exempt server is ever culled (a busy kernel, a running job, real UI input, a
keep-alive click), while an idle one and one with only its GPU panel open are."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from tests.harness.culler import (
    CHECK_INTERVAL_SECONDS,
    UI_IDLE_SECONDS,
    WARN_SECONDS,
    culling,
    culling_policy,
    decision_of,
    lab,
    make_culling_hub,
)
from tests.harness.hub import Hub, run_in_kernel
from tests.harness.jobs import put, until, user_client
from tests.harness.wait import wait_for, wait_for_async

PROFILE = "gpu-eighth"
#: T of the matrix: six servers, a job and a kernel take this long to start on a small machine,
#: and no exemption may come too late for it
MATRIX_UI_IDLE_SECONDS = 30


@pytest.fixture
def figures_dir() -> Iterator[Path]:
    """Where the simulated GPUs' figures are (readable by the servers' own accounts)."""
    path = Path(tempfile.mkdtemp(prefix="gpulab-culling-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _running(hub: Hub, user: str) -> bool:
    return hub.server_model(user) is not None


def _gone(hub: Hub, user: str) -> bool:
    return hub.server_model(user) is None


def _culled(hub: Hub, user: str) -> bool:
    """The culler decided to cull `user`'s server (it may still be stopping)."""
    return any(d["user"] == user and d["verdict"] == "cull" for d in culling(hub)["recent_actions"])


async def test_only_idle_servers_are_culled_and_never_an_exempt_one(
    make_hub: Any, tmp_path: Path, figures_dir: Path
) -> None:
    policy = culling_policy(dry_run=False, ui_idle_seconds=MATRIX_UI_IDLE_SECONDS)
    hub = make_culling_hub(make_hub, tmp_path, figures_dir, policy)
    for user in ("busy", "jobber", "keeper", "typist", "panel", "idle"):
        hub.create_user(user)
    # one server at a time, each exemption in place as soon as its server is up

    # a cell that runs all along, in a real kernel
    hub.start_server("busy", profile=PROFILE)
    busy_cell = asyncio.ensure_future(
        run_in_kernel(hub, "busy", "import time\ntime.sleep(600)", timeout=600)
    )

    async def kernel_busy() -> bool:
        d = decision_of(hub, "busy")
        return bool(d and "busy-kernels" in d["causes"])

    await wait_for_async("busy's kernel counted busy", kernel_busy, 60, 0.5)

    # a job run of the owner's, running all along
    hub.start_server("jobber", profile=PROFILE)
    put(hub, "jobber", "sleep.py", "import time\ntime.sleep(600)\n")
    jobber = user_client(hub, "jobber")
    r = jobber.post(
        "/users/jobber/jobs",
        json={"name": "long", "kind": "script", "path": "sleep.py", "profile": PROFILE},
    )
    assert r.status_code == 201, r.text
    until(jobber, f"/users/jobber/jobs/{r.json()['id']}", "running")

    # "Keep alive" clicked once
    hub.start_server("keeper", profile=PROFILE)
    r = lab(hub, "keeper").post("gpulab/culling/keep-alive")
    assert r.status_code == 200, r.text
    assert r.json()["keep_alive_until"] > time.time() + 500

    # somebody typing: what the lab's frontend reports of her keys, every half second
    hub.start_server("typist", profile=PROFILE)
    typing = threading.Event()

    def type_along() -> None:
        with lab(hub, "typist") as typist:
            while not typing.wait(0.5):
                r = typist.post("gpulab/culling/input", json={"kind": "ui-input"})
                assert r.status_code == 204, r.text

    typist_thread = threading.Thread(target=type_along, daemon=True)
    typist_thread.start()

    hub.start_server("panel", profile=PROFILE)
    hub.start_server("idle", profile=PROFILE)
    panel = lab(hub, "panel")
    ws = await websocket_connect(
        HTTPRequest(
            hub.url.replace("http://", "ws://") + "/user/panel/gpulab/monitor/ws?rate_hz=2",
            headers={"Authorization": f"token {hub.token}"},
        )
    )
    assert json.loads(await ws.read_message())["type"] == "hello"

    warned_at: dict[str, float] = {}
    panel_open = True
    try:
        # long enough for every server to be culled were it idle: T + W + a few checks after the
        # last start, with typist typing and panel's GPU panel open and polled all along
        deadline = time.monotonic() + MATRIX_UI_IDLE_SECONDS + WARN_SECONDS + 10
        while time.monotonic() < deadline or not (_gone(hub, "idle") and _gone(hub, "panel")):
            assert time.monotonic() < deadline + 30, culling(hub)
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
            for user in ("busy", "jobber", "typist", "keeper"):
                assert _running(hub, user), f"{user} was culled:\n{hub.log()[-4000:]}"
            await asyncio.sleep(0.5)
    finally:
        ws.close()
        busy_cell.cancel()
        typing.set()

    exempt = {u: decision_of(hub, u) for u in ("busy", "jobber", "typist", "keeper")}
    assert exempt["busy"]["verdict"] == "exempt" and "busy-kernels" in exempt["busy"]["causes"]
    assert exempt["jobber"]["verdict"] == "exempt"
    assert "running-jobs" in exempt["jobber"]["causes"]
    assert exempt["keeper"]["verdict"] == "exempt" and exempt["keeper"]["causes"][0] == "keep-alive"
    assert exempt["typist"]["verdict"] == "keep" and exempt["typist"]["causes"] == ["ui-input"]
    assert {"idle", "panel"} <= set(warned_at)
    assert not {"busy", "jobber", "typist", "keeper"} & set(warned_at)

    # each cull came W to W + one check interval after its warning (decisions on a 1 s grid)
    culls = {d["user"]: d for d in culling(hub)["recent_actions"] if d["verdict"] == "cull"}
    assert set(culls) == {"idle", "panel"}, culls
    for user, cull in culls.items():
        assert cull["effect"] == "stop" and cull["dry_run"] is False
        assert "no UI input for" in cull["reason"] and "below 5%" in cull["reason"]
        delay = cull["at"] - (cull["deadline"] - WARN_SECONDS)
        print(f"{user}: warned {warned_at[user]:.1f}, culled {delay:.2f} s after the warning")
        assert WARN_SECONDS <= delay <= WARN_SECONDS + CHECK_INTERVAL_SECONDS + 1e-6
    # their GPU shares are free again, the job's and the others' are held
    owners = {a["owner"] for a in hub.allocations().values()}
    assert owners == {"busy", "jobber", "typist", "keeper"}


def test_a_dry_run_culls_nothing_and_reports_what_it_would_cull(
    make_hub: Any, tmp_path: Path, figures_dir: Path
) -> None:
    hub = make_culling_hub(make_hub, tmp_path, figures_dir, culling_policy(dry_run=True))
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
    make_hub: Any, tmp_path: Path, figures_dir: Path
) -> None:
    policy = culling_policy()
    policy["profiles"] = {"gpu-ful": {"warn_seconds": 60}}
    hub = make_culling_hub(make_hub, tmp_path, figures_dir, policy, start=False)
    hub.start(expect_failure=True)
    assert hub.wait_exit() != 0
    assert "GPUCuller.policy.profiles.gpu-ful: no profile 'gpu-ful' in the catalog" in hub.log()


def test_a_server_moved_to_cpu_comes_back_on_the_cpu_profile(
    make_hub: Any, tmp_path: Path, figures_dir: Path
) -> None:
    hub = make_culling_hub(make_hub, tmp_path, figures_dir, culling_policy(action="downsize"))
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
    make_hub: Any, tmp_path: Path, figures_dir: Path
) -> None:
    hub = make_culling_hub(make_hub, tmp_path, figures_dir, culling_policy(dry_run=True))
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
    }
    r = bob.post("/users/bob/activity", json={"busy_kernels": -1})
    assert r.status_code == 400 and r.json()["message"].startswith("busy_kernels: expected a count")
    r = bob.post("/users/bob/servers/nope/activity", json={})
    assert r.status_code == 404 and "bob has no running server 'nope'" in r.json()["message"]
    # alice's own report was never replaced by bob's
    d = wait_for("a decision on alice", lambda: decision_of(hub, "alice"), 30, 0.5)
    assert "busy-kernels" not in d["causes"] and "keep-alive" not in d["causes"]
