"""dask-labextension on gpulab, its pure parts: ids the sidebar's routes take, the default
profile and factory, the sidebar's cluster model from the hub's answer, and where the dashboard
check may send this server's token (only to the hub, only for the owner's dashboards). The
manager against the real hub and the sidebar in a browser are the e2e tests."""

from __future__ import annotations

import re

import pytest

from gpulab.dask import ClusterInfo, HubDask
from jupyterlab_gpulab.dask_lab import (
    _replace_handler,
    cluster_model,
    default_profile,
    factory_config,
    hub_dashboard_url,
    hub_id,
    lab_id,
)

PROFILES = [
    {"slug": "cpu", "gpus": "CPU only"},
    {"slug": "quarter", "gpus": "1/4"},
    {"slug": "whole", "gpus": "1"},
]
CLUSTER = {
    "id": 12,
    "name": "etl",
    "owner": "alice",
    "state": "running",
    "profile": "quarter",
    "keep_alive": True,
    "n_workers": 3,
    "scheduler_address": "tls://127.0.0.1:4000",
    "dashboard_link": "/hub/gpulab/dask/alice/12/dashboard/status",
    "workers_running": 2,
    "waiting_reason": "no GPU free",
}


def test_lab_ids_fit_dask_labextensions_route_and_map_back():
    route = re.compile(r"^\w+-\w+-\w+-\w+-\w+$")  # dask_labextension's cluster_id_regex
    for number in (1, 12, 10**11):
        assert route.match(lab_id(number)) and hub_id(lab_id(number)) == number
    assert hub_id("6f1b2c3d-aaaa-bbbb-cccc-dddddddddddd") is None  # not one of the hub's


@pytest.mark.parametrize(
    "own, expected",
    [("whole", "whole"), ("cpu", "quarter"), ("", "quarter"), ("gone", "quarter")],
)
def test_default_profile_prefers_the_servers_own_gpu_profile(own, expected):
    assert default_profile(PROFILES, own) == expected


def test_default_profile_without_gpu_profiles():
    assert default_profile([{"slug": "cpu", "gpus": "CPU only"}], "cpu") == "cpu"
    assert default_profile([], "") is None


def test_factory_is_gpucluster_with_the_profile():
    assert factory_config("quarter") == {
        "module": "gpulab.dask",
        "class": "GPUCluster",
        "args": [],
        "kwargs": {"profile": "quarter"},
    }
    assert factory_config(None)["kwargs"] == {}


def test_sidebar_model_from_the_hubs_cluster(monkeypatch):
    monkeypatch.setenv("JUPYTERHUB_PUBLIC_HUB_URL", "https://lab.example.org/hub/")
    model = cluster_model(ClusterInfo.from_json({**CLUSTER, "minimum": 1, "maximum": 4}))
    assert model["id"] == lab_id(12) and model["name"] == "etl"
    assert model["workers"] == 2 and model["cores"] == 0  # not connected: the hub's count
    assert model["dashboard_link"] == (
        "https://lab.example.org/hub/gpulab/dask/alice/12/dashboard/status"
    )
    assert model["adapt"] == {"minimum": 1, "maximum": 4}
    monkeypatch.delenv("JUPYTERHUB_PUBLIC_HUB_URL")
    # no public URL: where the browser reached this server (the proxy routes /hub/ to the hub)
    model = cluster_model(ClusterInfo.from_json(CLUSTER), origin="http://127.0.0.1:8000")
    assert (
        model["dashboard_link"] == "http://127.0.0.1:8000/hub/gpulab/dask/alice/12/dashboard/status"
    )
    pending = cluster_model(ClusterInfo.from_json({**CLUSTER, "state": "pending"}))
    assert pending["dashboard_link"] == "" and "adapt" not in pending


def test_sidebar_model_counts_the_schedulers_workers():
    # the scheduler's identity(n_workers=0): its totals, with no worker described
    scheduler = {"n_workers": 4, "total_threads": 8, "total_memory": 4 * 2**30, "workers": {}}
    model = cluster_model(ClusterInfo.from_json(CLUSTER), scheduler)
    assert (model["workers"], model["cores"], model["memory"]) == (4, 8, "4.00 GiB")


def test_token_goes_only_to_the_hub_for_the_owners_dashboards(monkeypatch):
    """The dashboard check's URL comes from the browser: this server's token goes with it only
    to the hub's own address, and only for this owner's dashboards under a host that is the
    hub's (its API's, its public one, the proxy's the browser came through); never to another
    host, for another user's dashboards (the hub would refuse them anyway), or out of the path."""
    monkeypatch.setenv("JUPYTERHUB_PUBLIC_HUB_URL", "https://lab.example.org/hub/")
    hub = HubDask("http://10.0.0.5:8081/hub/api", "token", "alice")
    inside = "http://10.0.0.5:8081/hub/gpulab/dask/alice/12/dashboard"
    assert hub_dashboard_url(inside, hub) == inside
    public = "https://lab.example.org/hub/gpulab/dask/alice/12/dashboard"
    assert hub_dashboard_url(public, hub) == inside  # fetched from the hub itself
    proxy = "http://127.0.0.1:8000/hub/gpulab/dask/alice/12/dashboard"
    assert hub_dashboard_url(proxy, hub, own_host="127.0.0.1:8000") == inside
    for foreign in (
        "https://evil.example.com/hub/gpulab/dask/alice/12/dashboard",
        "http://10.0.0.5:8081/hub/gpulab/dask/bob/3/dashboard",
        "http://10.0.0.5:8081/hub/gpulab/dask/alice/../../api/users",
        "http://10.0.0.5:8081/hub/gpulab/dask/alice/%2e%2e/%2e%2e/api/users",
        "http://10.0.0.5:8081/hub/api/users",
        "http://127.0.0.1:8787/status",
    ):
        assert hub_dashboard_url(foreign, hub, own_host="127.0.0.1:8000") is None, foreign


def test_replace_handler_swaps_a_registered_route():
    from tornado.web import Application, RequestHandler

    class Old(RequestHandler):
        pass

    class New(Old):
        pass

    app = Application()
    app.add_handlers(".*$", [(r"/dask/dashboard-check/(?P<url>.+)", Old)])
    assert (
        _replace_handler(app.default_router, Old, New)
        + _replace_handler(app.wildcard_router, Old, New)
        >= 1
    )
    assert _replace_handler(app.default_router, Old, New) == 0  # none left
