"""Dask workers' GPU reports in a real hub: a worker on a (declared, simulated) quarter GPU
pushes its share's figures to gpulab-metrics with its own report token, which the admin overview
shows; the token reaches the worker's Nanny but not the worker process its tasks run in; another
user's token cannot push for it; scaling the worker away revokes its token."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from gpulab.spawner.names import (
    REPORT_NAME_ENV,
    REPORT_TOKEN_ENV,
    REPORT_URL_ENV,
    REPORT_USER_ENV,
)
from tests.harness.hub import Hub, fast_metrics_env
from tests.harness.wait import wait_for

OVERLAY = Config(
    GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB", "default_user_quota_gpus": 1},
    GPUDask={
        "admission_interval_seconds": 0.5,
        "monitor_interval_seconds": 0.5,
        "scheduler_cpu": 0.1,
        "scheduler_memory_mib": 256,
    },
)
BASE = "/users/{user}/dask-clusters"
#: a push body as the reporter sends it (only its target and token matter to these refusals)
BODY = "gpulab_monitor_simulated 1\n"


def server_client(hub: Hub, user: str) -> httpx.Client:
    """A client with the token of `user`'s running default server (a notebook's)."""
    token = hub.server_env(user)["JUPYTERHUB_API_TOKEN"]
    return httpx.Client(
        base_url=f"{hub.url}/hub/api/gpulab",
        headers={"Authorization": f"token {token}"},
        timeout=90,
    )


def cluster_model(client: httpx.Client, path: str, check: Any, what: str) -> dict[str, Any]:
    def current() -> dict[str, Any] | None:
        model = client.get(path).json()
        assert model.get("state") not in ("stopped", "failed"), model
        return dict(model) if check(model) else None

    return wait_for(what, current, 180, 0.3)


async def environments(credentials: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(the Nanny's, the worker process's) environment of the cluster's only worker."""
    from distributed import Client
    from distributed.security import Security

    security = Security(
        require_encryption=True,
        tls_ca_file=credentials["tls_cert"],
        tls_client_cert=credentials["tls_cert"],
        tls_client_key=credentials["tls_key"],
    )

    def environment() -> dict[str, str]:
        import os

        return dict(os.environ)

    async with Client(
        credentials["scheduler_address"], security=security, asynchronous=True
    ) as client:
        (nanny,) = (await client.run(environment, nanny=True)).values()
        (worker,) = (await client.run(environment)).values()
    return nanny, worker


def push(url: str, token: str, target: str) -> httpx.Response:
    return httpx.post(
        f"{url.rstrip('/')}/{target}",
        content=BODY,
        headers={"Authorization": f"token {token}", "Content-Type": "text/plain"},
        timeout=30,
    )


def test_a_dask_workers_report_is_accepted_for_it_alone_and_revoked_when_it_is_scaled_away(
    make_hub: Any, tmp_path: Path
) -> None:
    hub = make_hub(
        OVERLAY,
        env=fast_metrics_env(tmp_path),
    )
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")
    hub.start_server("bob", profile="cpu")
    alice = server_client(hub, "alice")
    r = alice.post(BASE.format(user="alice"), json={"profile": "gpu-quarter", "n_workers": 1})
    assert r.status_code == 201, r.text
    cid = r.json()["id"]
    path = f"{BASE.format(user='alice')}/{cid}"
    cluster_model(alice, path, lambda m: m["workers_running"] == 1, "one worker")
    worker_id = f"alice/dask-{cid}-w1"

    # the worker's pushes reach gpulab-metrics: its live figures are in the admin overview
    def worker_row() -> dict[str, Any] | None:
        r = hub.api("GET", "/gpulab/admin/overview", params={"kind": "dask"})
        assert r.status_code == 200, hub.log()[-3000:]
        rows = [w for w in r.json()["workloads"] if w["id"] == worker_id]
        return rows[0] if rows and rows[0]["utilization"] is not None else None

    row = wait_for("the worker's pushed figures in the overview", worker_row, 90, 0.5)
    assert row["monitored"] and row["live"]["age_seconds"] <= 15
    assert 0 <= row["utilization"] <= 100 and row["memory_used_mib"] is not None
    # the scheduler holds no GPU: no report of its own, no token
    notes = {t["note"] for t in hub.api("GET", "/users/alice/tokens").json()["api_tokens"]}
    assert f"gpulab GPU report for {worker_id}" in notes
    assert f"gpulab GPU report for alice/dask-{cid}-scheduler" not in notes

    credentials = alice.get(f"{path}/credentials").json()
    nanny, worker = asyncio.run(environments(credentials))
    # the report is in the worker's own environment; the worker process dropped the token (the
    # owner's tasks and their subprocesses run there)
    assert nanny[REPORT_USER_ENV] == "alice" and nanny[REPORT_NAME_ENV] == f"dask-{cid}-w1"
    assert REPORT_TOKEN_ENV not in worker and worker[REPORT_NAME_ENV] == f"dask-{cid}-w1"
    url, token = nanny[REPORT_URL_ENV], nanny[REPORT_TOKEN_ENV]
    # a token worth nothing but this worker's report: it says whose it is, and reads or does
    # nothing of hers (her tokens, her servers)
    as_report = {"Authorization": f"token {token}"}
    assert httpx.get(f"{hub.url}/hub/api/user", headers=as_report).json()["name"] == "alice"
    for method, route in (("GET", "/users/alice/tokens"), ("POST", "/users/alice/servers/x")):
        r = httpx.request(method, f"{hub.url}/hub/api{route}", headers=as_report)
        assert r.status_code == 403, (method, route, r.text)
    # another user's token cannot push for her worker, nor hers for another of her workloads
    bob_token = hub.server_env("bob")["JUPYTERHUB_API_TOKEN"]
    refused = push(url, bob_token, worker_id)
    assert refused.status_code == 403, refused.text
    assert push(url, token, f"alice/dask-{cid}-w2").status_code in (403, 404)

    # scaled away: the share is given back, and the token with it
    r = alice.patch(path, json={"n_workers": 0})
    assert r.status_code == 200, r.text
    cluster_model(alice, path, lambda m: m["workers_running"] == 0, "no worker running")
    wait_for("the worker's share given back", lambda: worker_id not in hub.allocations(), 60)

    def revoked() -> bool:
        r = httpx.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"})
        return r.status_code == 403

    wait_for("the worker's report token revoked", revoked, 30, 0.3)
    # gpulab-metrics refuses it too once its listing no longer has the worker (its HubAuth may
    # remember the token that long; the allocation is gone already)
    wait_for(
        "a push with the revoked token refused",
        lambda: push(url, token, worker_id).status_code == 403,
        60,
        1.1,  # slower than the service's push rate limit
    )
    notes = {t["note"] for t in hub.api("GET", "/users/alice/tokens").json()["api_tokens"]}
    assert not [n for n in notes if n.startswith("gpulab GPU report for")]
    assert alice.delete(path).json()["state"] == "stopped"
