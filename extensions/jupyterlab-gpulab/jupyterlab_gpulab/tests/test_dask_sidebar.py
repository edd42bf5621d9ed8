"""Dask clusters in the lab, through a real hub and real servers: dask-labextension's API in a
user's server answers from the hub (gpulab's manager), the "New GPU cluster" endpoint passes the
hub's refusals on word for word, the sidebar's worker count follows a scale while a notebook
holds the cluster, and in a real browser the dialog creates a cluster that the Dask sidebar
lists and whose dashboard pane opens through the hub, the sidebar's inserted client code
connects from a notebook, and the full dashboard is styled."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from traitlets.config import Config

from tests.harness.browser import log_in_as_admin, run_from_palette
from tests.harness.hub import Hub, merged, run_in_kernel
from tests.harness.jobs import INVENTORY, put
from tests.harness.labserver import EXTENSION_SRC

pytestmark = pytest.mark.slow


def _missing() -> str | None:
    for module in ("jupyterlab_gpulab", "dask_labextension"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed in this venv (bash .ci/dev setup installs it)"
    return None


def dask_overlay(**capacity: Any) -> Config:
    overlay = Config()
    overlay.Spawner.environment.update({"PYTHONPATH": str(EXTENSION_SRC)})
    if capacity:
        overlay.GPUCapacity.update(capacity)
    return merged(INVENTORY, overlay)


def lab(hub: Hub, user: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"{hub.url}/user/{user}",
        headers={"Authorization": f"token {hub.token}"},
        timeout=60,
    )


def until_state(hub: Hub, user: str, number: int, *states: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = hub.api("GET", f"/gpulab/users/{user}/dask-clusters/{number}")
        assert r.status_code == 200, r.text
        if r.json()["state"] in states or time.monotonic() > deadline:
            assert r.json()["state"] in states, r.json()
            return dict(r.json())
        time.sleep(0.3)


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_the_servers_dask_api_answers_from_the_hub(make_hub: Any) -> None:
    hub = make_hub(dask_overlay(default_user_quota_gpus=1))
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    client = lab(hub, "alice")
    r = client.get("/dask/clusters")
    assert r.status_code == 200 and r.json() == [], r.text
    # the dialog's endpoint: a field it does not know, named; the hub's quota refusal, verbatim
    r = client.post("/gpulab/dask/clusters", json={"profile": "gpu-1", "gpus": 3})
    assert r.status_code == 400 and r.json()["message"].startswith("gpus:"), r.text
    r = client.post("/gpulab/dask/clusters", json={"profile": "gpu-1", "n_workers": 3})
    assert r.status_code == 403, r.text
    direct = hub.api(
        "POST", "/gpulab/users/alice/dask-clusters", json={"profile": "gpu-1", "n_workers": 3}
    )
    assert direct.status_code == 403 and r.json()["message"] == direct.json()["message"]
    # a cluster made through the server is the hub's, recorded as this server's
    r = client.post(
        "/gpulab/dask/clusters",
        json={"profile": "gpu-quarter", "n_workers": 1, "name": "side", "keep_alive": False},
    )
    assert r.status_code == 201, r.text
    model = r.json()
    assert model["name"] == "side" and model["id"] == f"00000000-0000-0000-0000-{1:012d}"
    running = until_state(hub, "alice", model["hub_id"], "running")
    assert running["server"] == ""
    # the sidebar's list: the hub's cluster, with its workers once connected
    deadline = time.monotonic() + 60
    while True:
        listed = {c["name"]: c for c in client.get("/dask/clusters").json()}
        if listed.get("side", {}).get("cores", 0) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert listed["side"]["workers"] == 1 and listed["side"]["cores"] >= 1, (
        listed,
        [ln for ln in hub.log().splitlines() if "gpulab dask" in ln or "Error" in ln][-20:],
    )
    assert listed["side"]["dashboard_link"].endswith("/hub/gpulab/dask/alice/1/dashboard/status")
    # its dashboard check reaches the hub's dashboard with the server's token
    # (the sidebar sends it as encodeURIComponent does)
    check = client.get("/dask/dashboard-check/" + quote(listed["side"]["dashboard_link"], safe=""))
    assert check.status_code == 200 and check.json()["isActive"], check.text
    assert any("Task Stream" in name for name in check.json()["plots"]), check.json()
    # the sidebar's own dashboard proxy (its panes, once the cluster is clicked) reaches it too
    plots = client.get(f"/dask/dashboard/{model['id']}/individual-plots.json")
    assert plots.status_code == 200 and any("Task Stream" in n for n in plots.json()), plots.text
    # another user's server sees none of it: her list is hers, and its proxy (whose token
    # names bob alone) gets the hub's refusal for alice's cluster number
    hub.create_user("bob")
    hub.start_server("bob", profile="cpu")
    bob = lab(hub, "bob")
    assert bob.get("/dask/clusters").json() == []
    stolen = bob.get(f"/dask/dashboard/{model['id']}/individual-plots.json")
    assert stolen.status_code in (403, 404), stolen.text
    assert "Task Stream" not in stolen.text
    # the sidebar's shutdown stops it in the hub
    r = client.delete(f"/dask/clusters/{model['id']}")
    assert r.status_code == 204, r.text
    assert until_state(hub, "alice", 1, "stopped")["state"] == "stopped"


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_new_gpu_cluster_dialog_sidebar_and_dashboard_pane(make_hub: Any, page: Any) -> None:
    hub = make_hub(dask_overlay())
    log_in_as_admin(page, hub)
    page.check("#profile-cpu")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    page.wait_for_selector(".jp-LabShell", timeout=60_000)
    # "New GPU Cluster…" from the palette: a GPU profile, one worker, a name
    run_from_palette(page, "New GPU Cluster")
    form = page.locator("[data-testid=gpulab-dask-form]")
    form.wait_for(timeout=30_000)
    page.select_option("[data-testid=gpulab-dask-profile]", "gpu-quarter")
    page.fill("[data-testid=gpulab-dask-workers]", "1")
    page.fill("[data-testid=gpulab-dask-name]", "from-dialog")
    page.get_by_role("button", name="Create").click()
    form.wait_for(state="detached", timeout=30_000)
    # made by the hub (the dialog has closed; its request may still be on its way)
    deadline = time.monotonic() + 30
    while not (clusters := hub.api("GET", "/gpulab/users/admin/dask-clusters").json()["clusters"]):
        assert time.monotonic() < deadline, "the dialog made no cluster"
        time.sleep(0.3)
    (cluster,) = clusters
    assert cluster["name"] == "from-dialog" and cluster["profile"] == "gpu-quarter"
    until_state(hub, "admin", cluster["id"], "running")
    # the Dask sidebar (opened by the dialog) lists it
    item = page.locator(".dask-ClusterListingItem", has_text="from-dialog")
    item.wait_for(timeout=60_000)
    item.click()  # its dashboard becomes the sidebar's
    task_stream = page.locator(".dask-DashboardListing-item button", has_text="Task Stream")
    task_stream.wait_for(timeout=60_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.dask-DashboardListing-item button')]"
        ".some(b => b.textContent.includes('Task Stream') && !b.disabled)",
        timeout=60_000,
    )
    task_stream.click()
    frame = page.locator(".jp-MainAreaWidget iframe").last
    frame.wait_for(timeout=30_000)
    src = frame.get_attribute("src") or ""
    # dask-labextension's proxy in this server, which asks the hub; no token in the page
    assert "/user/admin/dask/dashboard/" in src and "token" not in src, src
    # Bokeh's pane renders inside: its scripts and websocket come from the hub's own paths,
    # with the browser's login cookie
    frame.content_frame.locator(".bk-Canvas, canvas, .bk-root, div.bk").first.wait_for(
        timeout=60_000
    )
    r = hub.api("DELETE", f"/gpulab/users/admin/dask-clusters/{cluster['id']}")
    assert r.status_code == 200 and r.json()["state"] == "stopped", r.text


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_the_sidebars_new_makes_a_cluster_of_the_default_gpu_profile(make_hub: Any) -> None:
    """dask-labextension's "+NEW" (PUT dask/clusters, no body) goes through the factory:
    GPUCluster on the owner's first GPU profile (her server's own gives none), made by the hub
    and kept when the server's manager lets go of it."""
    hub = make_hub(dask_overlay())
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    client = lab(hub, "alice")
    r = client.put("/dask/clusters")
    assert r.status_code == 200, r.text
    model = r.json()
    (cluster,) = hub.api("GET", "/gpulab/users/alice/dask-clusters").json()["clusters"]
    assert model["hub_id"] == cluster["id"] and cluster["state"] == "running"
    gpu_profiles = [s for s, p in hub.capacity().items() if p["gpus"] != "CPU only"]
    assert cluster["profile"] == gpu_profiles[0], (cluster, gpu_profiles)
    r = client.delete(f"/dask/clusters/{model['id']}")
    assert r.status_code == 204, r.text
    assert until_state(hub, "alice", cluster["id"], "stopped")["state"] == "stopped"


def hub_cluster(hub: Hub, user: str, **spec: Any) -> dict:
    """A cluster of `user`'s made through the hub's API, once running."""
    r = hub.api("POST", f"/gpulab/users/{user}/dask-clusters", json=spec)
    assert r.status_code == 201, r.text
    return until_state(hub, user, r.json()["id"], "running")


def listed_until(client: httpx.Client, name: str, check: Any, timeout: float = 90) -> dict:
    """The sidebar's model of cluster `name` (dask/clusters) once `check(model)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        listed = {c["name"]: c for c in client.get("/dask/clusters").json()}
        model = listed.get(name, {})
        if check(model) or time.monotonic() > deadline:
            assert check(model), json.dumps(listed)
            return dict(model)
        time.sleep(0.5)


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_the_sidebar_counts_workers_added_while_a_notebook_holds_the_cluster(
    make_hub: Any,
) -> None:
    """A notebook's GPUCluster subscribes to the scheduler's worker status, and a scheduler keeps
    one such subscriber: the sidebar, connected first, must not lose its count to it."""
    hub = make_hub(dask_overlay(default_user_quota_gpus=1))
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    client = lab(hub, "alice")
    cluster = hub_cluster(hub, "alice", profile="gpu-quarter", n_workers=2, name="grows")
    until_state(hub, "alice", cluster["id"], "running")
    listed_until(client, "grows", lambda m: m.get("workers") == 2 and m.get("cores", 0) >= 2)
    held = asyncio.run(
        run_in_kernel(
            hub,
            "alice",
            "from gpulab.dask import GPUCluster\n"
            "cluster = GPUCluster.from_name('grows')\n"
            "print('HELD', len(cluster.scheduler_info['workers']))\n",
            timeout=120,
            keep_kernel=True,
        )
    )
    assert "HELD 2" in held, held
    path = f"/gpulab/users/alice/dask-clusters/{cluster['id']}"
    r = hub.api("PATCH", path, json={"n_workers": 4})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 180
    while hub.api("GET", path).json()["workers_running"] < 4:
        assert time.monotonic() < deadline, hub.api("GET", path).json()
        time.sleep(0.5)
    model = listed_until(client, "grows", lambda m: m.get("workers") == 4, timeout=30)
    assert model["cores"] >= 4, model
    r = hub.api("DELETE", path)
    assert r.status_code == 200 and r.json()["state"] == "stopped", r.text


def _empty_notebook() -> str:
    return json.dumps(
        {
            "cells": [
                {
                    "cell_type": "code",
                    "metadata": {},
                    "source": "",
                    "outputs": [],
                    "execution_count": None,
                }
            ],
            "metadata": {
                "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_the_sidebars_inserted_client_code_connects_from_a_notebook(
    make_hub: Any, page: Any
) -> None:
    """dask-labextension's "<>" writes ``Client("<scheduler address>")`` and nothing else: run
    in the lab's notebook, it connects to the TLS scheduler and sees its worker."""
    hub = make_hub(dask_overlay())
    log_in_as_admin(page, hub)
    page.check("#profile-cpu")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    cluster = hub_cluster(hub, "admin", profile="gpu-quarter", n_workers=1, name="inserted")
    put(hub, "admin", "client.ipynb", _empty_notebook())
    page.goto(f"{hub.url}/user/admin/lab/tree/client.ipynb")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.locator(".jp-Notebook .jp-Cell .cm-content").first.click()
    page.locator(".lm-TabBar-tab[data-id=dask-dashboard-launcher]").click()
    item = page.locator(".dask-ClusterListingItem", has_text="inserted")
    # listed with its scheduler's address once the sidebar's poll has seen it running
    address = cluster["scheduler_address"]
    item.locator(f".dask-ClusterListingItem-link[title='{address}']").wait_for(timeout=60_000)
    item.locator("button.dask-ClusterListingItem-code").click()
    editor = page.locator(".jp-Notebook .jp-Cell .cm-content").first
    page.wait_for_function(
        "el => el.textContent.includes('Client(')", arg=editor.element_handle(), timeout=30_000
    )
    assert address in editor.inner_text()  # the address, no credentials
    editor.click()
    page.keyboard.press("Shift+Enter")
    output = page.locator(".jp-Notebook .jp-Cell .jp-OutputArea-output").first
    output.wait_for(timeout=120_000)
    page.wait_for_function(
        "el => /Client|Error/.test(el.textContent)", arg=output.element_handle(), timeout=120_000
    )
    text = output.text_content() or ""
    assert "Error" not in text, text
    assert re.search(r"Workers:\s*1\b", text), text
    r = hub.api("DELETE", f"/gpulab/users/admin/dask-clusters/{cluster['id']}")
    assert r.status_code == 200 and r.json()["state"] == "stopped", r.text


@pytest.mark.skipif(_missing() is not None, reason=_missing() or "")
def test_the_full_dashboard_through_the_hub_is_styled(make_hub: Any, page: Any) -> None:
    """The dashboard link (``cluster.dashboard_link``, the sidebar's) opened in a browser: its
    statics come with their own types and its stylesheet applies."""
    hub = make_hub(dask_overlay())
    log_in_as_admin(page, hub)
    cluster = hub_cluster(
        hub, "admin", profile="gpu-quarter", n_workers=1, name="styled", keep_alive=True
    )
    statics: dict[str, str] = {}
    page.on(
        "response",
        lambda r: (
            statics.__setitem__(r.url, r.headers.get("content-type", ""))
            if "/statics/" in r.url
            else None
        ),
    )
    page.goto(f"{hub.url}{cluster['dashboard_link']}")
    # distributed's base.css paints the page #FAFAFA: only a stylesheet taken as CSS does
    page.wait_for_function(
        "() => getComputedStyle(document.documentElement).backgroundColor === 'rgb(250, 250, 250)'",
        timeout=30_000,
    )
    css = {url: kind for url, kind in statics.items() if url.endswith(".css")}
    assert css and all(kind.startswith("text/css") for kind in css.values()), css
    svg = {url: kind for url, kind in statics.items() if url.endswith(".svg")}
    assert all(kind.startswith("image/svg+xml") for kind in svg.values()), svg
    r = hub.api("DELETE", f"/gpulab/users/admin/dask-clusters/{cluster['id']}")
    assert r.status_code == 200 and r.json()["state"] == "stopped", r.text
