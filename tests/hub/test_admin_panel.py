"""The GPU admin panel on a real hub: its REST overview and bulk actions on real servers, who may
use them, and the page in a real browser (table, filter, stop, CSV export).

One hub for the module (a declared 2 x A100 inventory, a preemptible profile added to the default
catalog); every test starts servers of users of its own and leaves none running.
"""

from __future__ import annotations

import csv
import io
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from jinja2 import ChoiceLoader, Environment, FileSystemLoader, PrefixLoader
from jupyterhub._data import DATA_FILES_PATH
from traitlets.config import Config

from gpulab.hub.apihandlers.admin import workload_kind
from gpulab.hub.config import TEMPLATES
from gpulab.hub.profiles import DEFAULT_CATALOG
from gpulab.hub.scopes import ADMIN_READ, PREEMPT
from tests.harness.browser import log_in_as_admin
from tests.harness.hub import Hub
from tests.harness.jobs import put, until, user_client

INVENTORY = "2 x A100-SXM4-80GB"
MODEL = "A100-SXM4-80GB"
SPOT = {"slug": "gpu-spot", "display_name": "1/4 GPU, preemptible", "gpus": "1/4"}
SPOT["priority"] = "preemptible"
PASSWORD = "correct horse battery staple"
ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


def _overlay() -> Config:
    c = Config()
    c.GPUCapacity.declared_inventory = INVENTORY
    c.GPUCapacity.profiles = [dict(p) for p in DEFAULT_CATALOG] + [SPOT]
    c.GPUJobs.admission_interval_seconds = 0.5
    # the panel's operator: reads the panel, preempts, and stops anyone's servers (JupyterHub's
    # own `servers` scope); the viewer only reads; the hub's admin reads and preempts (and holds
    # JupyterHub's admin role, so may stop servers too)
    c.JupyterHub.load_roles.extend(
        [
            {
                "name": "gpu-operator",
                "scopes": [ADMIN_READ, PREEMPT, "servers"],
                "users": ["operator"],
            },
            {"name": "gpu-viewer", "scopes": [ADMIN_READ], "users": ["viewer"]},
            {"name": "gpu-admin-panel", "scopes": [ADMIN_READ, PREEMPT], "users": ["admin"]},
        ]
    )
    return c


@pytest.fixture(scope="module")
def hub(make_module_hub: Any) -> Hub:
    # no gpulab-metrics: these servers push no figures, so the live columns stay null here
    # (tests/hub/ledger/test_in_hub.py shows them filled from real pushes)
    return make_module_hub(_overlay(), env={"GPULAB_METRICS_SERVICE": "0"})


def _token(hub: Hub, user: str) -> httpx.Client:
    """A REST client with a fresh token of `user` (all of her scopes)."""
    hub.create_user(user)
    r = hub.api("POST", f"/users/{user}/tokens", json={"note": "admin panel test"})
    assert r.status_code == 201, r.text
    return httpx.Client(
        base_url=f"{hub.url}/hub/api",
        headers={"Authorization": f"token {r.json()['token']}"},
        timeout=90,
    )


def _overview(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/gpulab/admin/overview")
    assert r.status_code == 200, r.text
    return r.json()


def _act(client: httpx.Client, action: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    r = client.post("/gpulab/admin/actions", json={"action": action, "ids": ids})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["id"] for x in results] == ids
    return {x["id"]: x for x in results}


def _stop_all(hub: Hub, *servers: tuple[str, str]) -> None:
    for user, name in servers:
        if hub.server_model(user, name) is not None:
            hub.stop_server(user, name)


def test_the_overview_lists_each_running_server_with_its_gpu_owner_and_idle_time(hub):
    hub.create_user("alice", groups=("students",))
    hub.create_user("bob")
    try:
        hub.start_server("alice", "", "gpu-quarter")
        hub.start_server("bob", "train", "gpu-half")
        overview = _overview(_token(hub, "viewer"))
    finally:
        _stop_all(hub, ("alice", ""), ("bob", "train"))

    workloads = {w["id"]: w for w in overview["workloads"]}
    alice, bob = workloads["alice/"], workloads["bob/train"]
    assert alice["kind"] == "server" and bob["kind"] == "server"
    assert (alice["owner"], alice["groups"], alice["profile"]) == (
        "alice",
        ["students"],
        "gpu-quarter",
    )
    assert (bob["owner"], bob["groups"], bob["profile"]) == ("bob", [], "gpu-half")
    assert (alice["gpu_model"], alice["mig_profile"], alice["gpus"]) == (MODEL, None, 0.25)
    assert [d["fraction"] for d in alice["devices"]] == [0.25]
    assert [d["fraction"] for d in bob["devices"]] == [0.5]
    assert alice["devices"][0]["index"] in (0, 1)
    assert alice["tier"] == "on-demand" and alice["over_quota"] is False
    assert alice["monitored"] is True  # a server's GPU monitor pushes its figures
    assert alice["server"]["name"] == "" and alice["server"]["url"] == "/user/alice/"
    assert bob["server"]["name"] == "train" and bob["server"]["url"] == "/user/bob/train/"
    assert 0 <= alice["ui_idle_seconds"] < 600
    assert alice["started_at"].endswith("Z")
    # no metrics service on this hub: the live columns are present, and null rather than invented
    for key in ("gpu_idle_seconds", "utilization", "memory_used_mib", "live"):
        assert alice[key] is None
    assert "declared" in overview["inventory"]

    (node,) = overview["nodes"]
    assert [g["index"] for g in node["gpus"]] == [0, 1]
    assert {g["model"] for g in node["gpus"]} == {MODEL}
    shares = {
        s["id"]: (g["uuid"], s["owner"], s["milli"]) for g in node["gpus"] for s in g["shares"]
    }
    assert shares["alice/"] == (alice["devices"][0]["uuid"], "alice", 250)
    assert shares["bob/train"] == (bob["devices"][0]["uuid"], "bob", 500)


def test_a_user_without_the_admin_read_scope_gets_403_from_the_overview_and_the_page(hub):
    r = _token(hub, "mallory").get("/gpulab/admin/overview")
    assert r.status_code == 403
    assert ADMIN_READ in r.json()["message"]
    r = _token(hub, "mallory").post("/gpulab/admin/actions", json={"action": "stop", "ids": ["x/"]})
    assert r.status_code == 403

    # the hub's admin holds JupyterHub's admin role, but the page needs the panel's own scope:
    # carol (signed up and approved, no role) may not; admin (given the scope) may
    carol = _signed_up_and_approved(hub, "carol")
    assert carol.get("/hub/gpulab/admin").status_code == 403
    assert "GPU admin" not in carol.get("/hub/home").text
    admin = hub.login("admin", hub.admin_password())
    page = admin.get("/hub/gpulab/admin")
    assert page.status_code == 200
    assert 'id="gpulab-admin-root"' in page.text
    assert "/hub/gpulab/admin/static/admin-panel.js?v=" in page.text
    assert 'href="/hub/gpulab/admin">GPU admin</a>' in admin.get("/hub/home").text
    bundle = admin.get("/hub/gpulab/admin/static/admin-panel.js")
    assert bundle.status_code == 200 and len(bundle.content) > 10_000


def test_bulk_stop_stops_two_servers_and_releases_their_gpu_shares(hub):
    free_before = hub.capacity()["gpu-quarter"]["free"]
    for user in ("dave", "erin"):
        hub.create_user(user)
        hub.start_server(user, "", "gpu-quarter")
    try:
        assert {"dave/", "erin/"} <= set(hub.allocations())
        # reading the panel is not stopping: the viewer lacks JupyterHub's scope for it
        refused = _act(_token(hub, "viewer"), "stop", ["dave/"])
        assert refused["dave/"]["ok"] is False
        assert "delete:servers" in refused["dave/"]["message"]
        assert hub.server_model("dave") is not None

        results = _act(_token(hub, "operator"), "stop", ["dave/", "erin/"])
        for id_ in ("dave/", "erin/"):
            assert results[id_]["ok"] is True, results
            assert "its GPU share is free" in results[id_]["message"]
        assert hub.server_model("dave") is None and hub.server_model("erin") is None
        assert not {"dave/", "erin/"} & set(hub.allocations())
        assert hub.capacity()["gpu-quarter"]["free"] == free_before
    finally:
        _stop_all(hub, ("dave", ""), ("erin", ""))


def test_preempt_is_refused_for_on_demand_work_and_unknown_ids_are_answered_per_id(hub):
    hub.create_user("frank")
    hub.start_server("frank", "", "gpu-quarter")
    try:
        results = _act(_token(hub, "operator"), "preempt", ["frank/", "nobody/nothing"])
        assert results["frank/"]["ok"] is False
        assert "on-demand" in results["frank/"]["message"]
        assert results["nobody/nothing"] == {
            "id": "nobody/nothing",
            "ok": False,
            "message": "No such allocation (released already?)",
        }
        assert hub.server_model("frank")["ready"] is True
        assert "frank/" in hub.allocations()
    finally:
        _stop_all(hub, ("frank", ""))


def test_preempt_stops_a_preemptible_server_and_needs_the_preempt_scope(hub):
    hub.create_user("gina")
    hub.start_server("gina", "", "gpu-spot")
    try:
        workloads = {w["id"]: w for w in _overview(_token(hub, "viewer"))["workloads"]}
        assert workloads["gina/"]["tier"] == "preemptible"
        refused = _act(_token(hub, "viewer"), "preempt", ["gina/"])
        assert refused["gina/"]["ok"] is False and PREEMPT in refused["gina/"]["message"]

        results = _act(_token(hub, "operator"), "preempt", ["gina/"])
        assert results["gina/"]["ok"] is True
        assert results["gina/"]["message"].startswith("Preempted: Stopped gina's default server")
        assert hub.server_model("gina") is None
        assert "gina/" not in hub.allocations()
    finally:
        _stop_all(hub, ("gina", ""))


def _running_job(hub: Hub, user: str, **spec: Any) -> tuple[httpx.Client, int]:
    """`user`'s job run of a script that sleeps, once it runs on a 1/4 GPU share."""
    hub.create_user(user)
    hub.start_server(user, profile="cpu")  # makes her account and home
    put(hub, user, "sleep.py", "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    hub.stop_server(user)
    client = user_client(hub, user)
    body = {"name": "long", "kind": "script", "path": "sleep.py", "profile": "gpu-quarter"}
    r = client.post(f"/users/{user}/jobs", json={**body, **spec})
    assert r.status_code == 201, r.text
    run_id = int(r.json()["id"])
    until(client, f"/users/{user}/jobs/{run_id}", "running")
    return client, run_id


def test_a_running_job_is_listed_as_a_job_and_stop_cancels_it_freeing_its_share(hub, page):
    kim, run_id = _running_job(hub, "kim")
    allocation = f"kim/job-{run_id}"
    try:
        workloads = {w["id"]: w for w in _overview(_token(hub, "viewer"))["workloads"]}
        job = workloads[allocation]
        assert (job["kind"], job["owner"], job["gpus"]) == ("job", "kim", 0.25)
        assert job["server"] is None and job["ui_idle_seconds"] is None
        # a job run reports its GPU figures (to gpulab-metrics, which this hub does not run:
        # tests/hub/ledger/test_in_hub.py has them), so it is monitored, with no figure yet
        assert job["monitored"] is True and job["utilization"] is None
        log_in_as_admin(page, hub)
        page.goto(f"{hub.url}/hub/gpulab/admin")
        row = page.get_by_role("table", name="Workloads").get_by_role(
            "row", name=f"Workload {allocation}"
        )
        row.wait_for(timeout=30_000)
        assert "not monitored" not in row.inner_text()

        results = _act(_token(hub, "operator"), "stop", [allocation])
        assert results[allocation]["ok"] is True, results
        assert results[allocation]["message"] == (
            f"Canceled job run {run_id} of kim (canceled); its GPU share is free"
        )
        assert allocation not in hub.allocations()
        run = kim.get(f"/users/kim/jobs/{run_id}").json()
        assert run["state"] == "canceled" and run["reason"] == "stopped by operator (admin panel)"
    finally:
        kim.delete(f"/users/kim/jobs/{run_id}")


def test_preempting_a_preemptible_job_requeues_it_and_its_next_attempt_keeps_its_share(hub):
    lena, run_id = _running_job(hub, "lena", preemptible=True)
    allocation = f"lena/job-{run_id}"
    try:
        results = _act(_token(hub, "operator"), "preempt", [allocation])
        assert results[allocation] == {
            "id": allocation,
            "ok": True,
            "message": f"Preempted {allocation}; its GPU share is free",
        }
        # the run is queued again and admitted anew under the same allocation id: the preemption
        # released only the first attempt's share, not the second's
        deadline = time.monotonic() + 60
        run = lena.get(f"/users/lena/jobs/{run_id}").json()
        while not (len(run["attempts"]) == 2 and run["state"] == "running"):
            assert time.monotonic() < deadline, run
            time.sleep(0.3)
            run = lena.get(f"/users/lena/jobs/{run_id}").json()
        assert run["attempts"][0]["state"] == "preempted"
        assert "preempted by operator from the admin panel" in run["attempts"][0]["reason"]
        assert allocation in hub.allocations()
    finally:
        lena.delete(f"/users/lena/jobs/{run_id}")


@pytest.fixture(scope="module")
def hank(hub: Hub) -> Any:
    """A running server the bad bodies name: it must still run after each of them."""
    hub.create_user("hank")
    hub.start_server("hank", "", "gpu-eighth")
    yield "hank/"
    _stop_all(hub, ("hank", ""))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (["hank/"], "must be a JSON object"),
        ({"action": "delete", "ids": ["hank/"]}, "action: 'delete' is none of stop, preempt"),
        ({"action": "stop"}, "ids: expected a non-empty list"),
        ({"action": "stop", "ids": []}, "ids: expected a non-empty list"),
        ({"action": "stop", "ids": "hank/"}, "ids: expected a non-empty list"),
        ({"action": "stop", "ids": ["hank/", 3]}, "every id must be a non-empty string"),
        ({"action": "stop", "ids": ["hank/", "hank/"]}, "'hank/' appears more than once"),
        ({"action": "stop", "ids": ["hank/"], "force": True}, "Unknown field(s) ['force']"),
    ],
)
def test_a_bad_action_body_is_a_400_that_says_why_and_does_nothing(hub, hank, body, says):
    r = _token(hub, "operator").post("/gpulab/admin/actions", json=body)
    assert r.status_code == 400
    assert says in r.json()["message"]
    assert hub.server_model("hank")["ready"] is True
    assert hank in hub.allocations()


def test_a_bad_json_body_is_a_400(hub):
    r = _token(hub, "operator").post(
        "/gpulab/admin/actions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400


def test_the_page_lists_servers_filters_stops_the_selected_one_and_exports_csv(hub, page, tmp_path):
    for user in ("ivan", "judy"):
        hub.create_user(user)
        hub.start_server(user, "", "gpu-quarter")
    try:
        log_in_as_admin(page, hub)
        page.goto(f"{hub.url}/hub/gpulab/admin")
        table = page.get_by_role("table", name="Workloads")
        ivan = table.get_by_role("row", name="Workload ivan/")
        judy = table.get_by_role("row", name="Workload judy/")
        ivan.wait_for(timeout=30_000)
        assert judy.is_visible()
        assert "1/4 GPU" in ivan.inner_text() and MODEL in ivan.inner_text()
        page.get_by_role("img", name="Top consumers by GPU-hours").wait_for()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "admin-panel.png"), full_page=True)

        page.get_by_label("Filter by owner or kind").fill("judy")
        judy.wait_for()
        ivan.wait_for(state="detached")
        assert table.locator("tbody tr").count() == 1

        with page.expect_download() as download_info:
            page.get_by_role("button", name="Export CSV").click()
        target = tmp_path / "workloads.csv"
        download_info.value.save_as(target)
        rows = list(csv.DictReader(io.StringIO(Path(target).read_text())))
        assert [(r["id"], r["owner"], r["kind"], r["share"]) for r in rows] == [
            ("judy/", "judy", "server", "1/4 GPU")
        ]
        assert rows[0]["gpu_model"] == MODEL and rows[0]["tier"] == "on-demand"
        assert rows[0]["monitored"] == "true"

        page.once("dialog", lambda dialog: dialog.accept())
        judy.get_by_role("checkbox", name="Select judy/").check()
        page.get_by_role("button", name="Stop selected workloads").click()
        result = page.get_by_role("status", name="Action results")
        result.wait_for(timeout=90_000)
        assert "judy/: Stopped judy's default server; its GPU share is free" in result.inner_text()
        judy.wait_for(state="detached", timeout=30_000)
        assert hub.server_model("judy") is None
        assert hub.server_model("ivan")["ready"] is True
    finally:
        _stop_all(hub, ("ivan", ""), ("judy", ""))


def _signed_up_and_approved(hub: Hub, username: str) -> httpx.Client:
    """A person who signed up and whom the admin approved, logged in (cookies); no role."""
    visitor = httpx.Client(base_url=hub.url, follow_redirects=True, timeout=30)
    visitor.get("/hub/signup")
    form = {"username": username, "signup_password": PASSWORD}
    form.update(signup_password_confirmation=PASSWORD, _xsrf=visitor.cookies.get("_xsrf", ""))
    assert visitor.post("/hub/signup", data=form).status_code == 200
    admin = hub.login("admin", hub.admin_password())
    approve = {"action": "approve", "_xsrf": admin.cookies.get("_xsrf", path="/hub/")}
    assert admin.post(f"/hub/authorize/{username}", data=approve).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        try:
            return hub.login(username, PASSWORD)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# -- without a hub -------------------------------------------------------------------------------


def test_workload_kind_tells_servers_jobs_and_dask_workers_apart():
    servers = {"alice/": object(), "alice/job-3": object()}
    assert workload_kind("alice/", servers) == "server"
    # a named server called "job-3" is a server: JupyterHub's record comes first
    assert workload_kind("alice/job-3", servers) == "server"
    assert workload_kind("bob/job-3", servers) == "job"
    assert workload_kind("bob/dask-7-w2", servers) == "dask"
    assert workload_kind("bob/dask-7-scheduler", servers) == "dask"
    # a server's allocation whose record is gone (reconciliation releases it)
    assert workload_kind("bob/notebook", servers) == "server"


def _render(template: str, **values: Any) -> str:
    """A gpulab template as JupyterHub renders it: gpulab's folder before JupyterHub's own, and
    JupyterHub's under the `templates/` prefix (JupyterHub.init_tornado_settings)."""
    jupyterhub_templates = str(Path(DATA_FILES_PATH) / "templates")
    loader = ChoiceLoader(
        [
            PrefixLoader({"templates": FileSystemLoader([jupyterhub_templates])}, "/"),
            FileSystemLoader([str(TEMPLATES), jupyterhub_templates]),
        ]
    )
    env = Environment(loader=loader, autoescape=True)
    page = dict(base_url="/hub/", prefix="/", xsrf_token="t", static_url=lambda *a, **k: "/s")
    return env.get_template(template).render(**page, **values)


def test_the_page_says_plainly_when_the_app_is_not_built():
    html = _render(
        "gpulab-admin.html", bundle_url=None, api_url="/hub/api/gpulab/admin/", parsed_scopes={}
    )
    assert "The GPU admin panel's app is not built" in html
    assert "bash .ci/dev setup" in html
    assert "gpulab-admin-root" not in html and '<script src="None"' not in html


def test_every_hub_page_links_the_panel_for_holders_of_its_scope_only():
    user = SimpleNamespace(name="ops", json_escaped_name="ops", spawner=None)
    link = '<a class="nav-link gpulab-nav-admin" href="/hub/gpulab/admin">GPU admin</a>'
    with_scope = _render("page.html", user=user, parsed_scopes={ADMIN_READ: "all"})
    without = _render("page.html", user=user, parsed_scopes={"read:users": "all"})
    assert link in with_scope
    assert "gpulab/admin" not in without
    # JupyterHub's own items stay
    assert 'href="/hub/token">Token</a>' in with_scope
