"""gpulab.dask's pure parts: the hub's answers parsed, its refusals as exceptions with the hub's
own text, the create body, the dashboard URL, and the client's TLS against a real TLS scheduler.
The client against the real hub is in the e2e tests (tests/hub/daskservice/test_e2e_gpucluster.py
once the hub's REST lands)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from distributed import Scheduler
from distributed.core import rpc
from distributed.security import Security

from gpulab.dask import (
    ClusterInfo,
    DaskClusterNotFound,
    DaskNameTaken,
    DaskQuotaError,
    HubDask,
    HubDaskError,
    HubUnavailable,
)
from gpulab.dask.cluster import HubAdaptive, create_body, security_loader, security_of
from gpulab.dask.hubapi import Credentials, dashboard_url, error_of

CLUSTER = {
    "id": 7,
    "name": "etl",
    "owner": "alice",
    "server": "",
    "profile": "1/4 GPU",
    "state": "running",
    "reason": None,
    "keep_alive": False,
    "n_workers": 2,
    "minimum": None,
    "maximum": None,
    "idle_timeout_seconds": 1800,
    "created": "2026-12-04T14:00:00Z",
    "scheduler_address": "tls://127.0.0.1:40001",
    "dashboard_link": "/hub/gpulab/dask/alice/7/dashboard/status",
    "workers": [
        {
            "number": 1,
            "name": "dask-etl-w1",
            "state": "running",
            "reason": None,
            "node": "n1",
            "share": "1/4 GPU",
            "gpus": ["GPU-1"],
        },
        {
            "number": 2,
            "name": "dask-etl-w2",
            "state": "pending",
            "reason": "no GPU free",
            "node": None,
            "share": None,
            "gpus": [],
        },
    ],
    "workers_running": 1,
    "waiting_reason": "no GPU free",
}


def test_cluster_object_parsed():
    info = ClusterInfo.from_json(CLUSTER)
    assert (info.id, info.name, info.owner, info.state) == (7, "etl", "alice", "running")
    assert info.is_live and not info.adaptive
    assert info.workers[0].gpus == ("GPU-1",) and info.workers[1].reason == "no GPU free"
    assert info.workers_running == 1 and info.waiting_reason == "no GPU free"
    adaptive = ClusterInfo.from_json({**CLUSTER, "minimum": 0, "maximum": 4, "state": "stopped"})
    assert adaptive.adaptive and not adaptive.is_live


def test_cluster_object_missing_field_names_it():
    broken = {k: v for k, v in CLUSTER.items() if k != "owner"}
    with pytest.raises(ValueError, match="owner"):
        ClusterInfo.from_json(broken)


def test_credentials_keep_key_out_of_repr():
    creds = Credentials.from_json(
        {"scheduler_address": "tls://x:1", "tls_cert": "CERT", "tls_key": "SECRET"}
    )
    assert "SECRET" not in repr(creds)
    with pytest.raises(ValueError, match="tls_key"):
        Credentials.from_json({"scheduler_address": "tls://x:1", "tls_cert": "C"})


@pytest.mark.parametrize(
    "status, kind",
    [(403, DaskQuotaError), (404, DaskClusterNotFound), (409, DaskNameTaken), (400, HubDaskError)],
)
def test_refusal_keeps_the_hubs_message(status, kind):
    message = "n_workers: 6 workers of 1/4 GPU exceed your quota of 1 GPU; at most 4 fit"
    error = error_of(status, json.dumps({"status": status, "message": message}).encode())
    assert type(error) is kind and isinstance(error, HubDaskError)
    assert str(error) == message and error.status == status


def test_refusal_without_json_says_the_status():
    error = error_of(502, b"<html>bad gateway</html>", "Bad Gateway")
    assert str(error) == "the hub answered 502: Bad Gateway"


def test_create_body_only_what_was_chosen():
    assert create_body(None, None, None, False, None, None, None) == {"keep_alive": False}
    assert create_body("1/4 GPU", 2, "etl", True, {"A": "1"}, 600, True) == {
        "profile": "1/4 GPU",
        "n_workers": 2,
        "name": "etl",
        "keep_alive": True,
        "environment": {"A": "1"},
        "idle_timeout_seconds": 600,
        "preemptible": True,
    }


def test_dashboard_url_absolute_from_the_public_hub_url():
    path = "/base/hub/gpulab/dask/alice/7/dashboard/status"
    env = {"JUPYTERHUB_PUBLIC_HUB_URL": "https://lab.example.org/base/hub/"}
    assert dashboard_url(path, env) == "https://lab.example.org" + path
    env = {"JUPYTERHUB_PUBLIC_URL": "http://lab:8000/base/"}
    assert dashboard_url(path, env) == "http://lab:8000" + path
    # no public URL known: the path, which the lab's own origin (the hub's) resolves
    assert dashboard_url(path, {}) == path


def test_hub_client_needs_the_servers_environment():
    with pytest.raises(HubUnavailable, match="JUPYTERHUB_API_TOKEN"):
        HubDask.from_env({"JUPYTERHUB_API_URL": "http://hub/hub/api", "JUPYTERHUB_USER": "a"})
    hub = HubDask.from_env(
        {
            "JUPYTERHUB_API_URL": "http://hub:8081/hub/api/",
            "JUPYTERHUB_API_TOKEN": "t",
            "JUPYTERHUB_USER": "al ice",
        }
    )
    assert hub.clusters_url == "http://hub:8081/hub/api/gpulab/users/al%20ice/dask-clusters"


def test_security_loader_leaves_what_is_not_a_hub_cluster_to_distributed(monkeypatch):
    """distributed's own defaults (None) outside a server the hub started, and for an address
    without TLS, without asking anyone; a warning when the hub cannot be asked. A cluster's address is in the
    lab's browser test (the sidebar's inserted code)."""
    for name in ("JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_USER"):
        monkeypatch.delenv(name, raising=False)
    assert security_loader({"address": "tls://127.0.0.1:4000"}) is None
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:9/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t")
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    assert security_loader({"address": "tcp://127.0.0.1:4000"}) is None
    assert security_loader({"address": "inproc://x"}) is None
    # a hub that does not answer: distributed's defaults, with the reason
    with pytest.warns(UserWarning, match="could not say whether tls://127.0.0.1:4000"):
        assert security_loader({"address": "tls://127.0.0.1:4000"}) is None


async def test_hub_adaptive_awaits_the_hubs_answer():
    import asyncio

    async def refused():
        raise DaskQuotaError(403, "maximum: over quota")

    adaptive = HubAdaptive(0, 8, asyncio.ensure_future(refused()))
    assert (adaptive.minimum, adaptive.maximum) == (0, 8)
    adaptive.stop()  # the hub's loop: nothing to stop here
    with pytest.raises(DaskQuotaError, match="over quota"):
        await adaptive


def _files_under(path: str) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs}


async def test_client_tls_reaches_a_tls_scheduler_with_the_clusters_credentials(
    tmp_path, monkeypatch
):
    """The client's Security from in-memory PEM (what /credentials answers) is accepted by a
    scheduler of those credentials, another cluster's is refused, and no key is left on disk."""
    mine, other = Security.temporary(), Security.temporary()
    # Security.temporary's cert is its own CA, as the hub's per-cluster credentials are
    creds = Credentials("", mine.tls_client_cert, mine.tls_client_key)
    # temporary files of this test only (other processes write to the machine's /tmp too)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    async with Scheduler(
        protocol="tls", host="127.0.0.1", port=0, security=mine, dashboard_address=":0"
    ) as scheduler:
        client_security = security_of(creds)
        async with rpc(
            scheduler.address, connection_args=client_security.get_connection_args("client")
        ) as comm:
            assert (await comm.identity())["type"] == "Scheduler"
        stranger = security_of(Credentials("", other.tls_client_cert, other.tls_client_key))
        with pytest.raises(OSError):
            async with rpc(
                scheduler.address,
                timeout=2,
                connection_args=stranger.get_connection_args("client"),
            ) as comm:
                await comm.identity()
    assert [f for f in _files_under(str(tmp_path)) if f.endswith((".pem", ".crt"))] == []
