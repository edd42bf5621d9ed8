"""Dask clusters through a real hub's REST API, with a notebook server's own token (what
`gpulab.dask.GPUCluster` uses): a cluster of two workers on quarter GPUs computes a real dask
array sum with the credentials the API gives, each worker's environment shows its share; a
request beyond quota is refused whole naming the limit; scale up and down with a worker waiting
for a free share; the cluster stops with its server unless kept alive, and DELETE leaves no
process and frees every share; another user's server token reaches nothing of it; the dashboard
answers through the hub for the owner only."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import psutil
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect
from traitlets.config import Config

from gpulab.spawner.local.dask import FORKSERVER_MODULE
from gpulab.spawner.names import GPU_FRACTION_ENV
from tests.harness.hub import Hub

INVENTORY = Config(
    GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB", "default_user_quota_gpus": 1},
    GPUDask={
        "admission_interval_seconds": 0.5,
        "monitor_interval_seconds": 0.5,
        "scheduler_cpu": 0.1,
        "scheduler_memory_mib": 256,
    },
)
BASE = "/users/{user}/dask-clusters"


def server_client(hub: Hub, user: str, server: str = "") -> httpx.Client:
    """A client with the token of `user`'s running server (a notebook's JUPYTERHUB_API_TOKEN)."""
    token = hub.server_env(user, server)["JUPYTERHUB_API_TOKEN"]
    return httpx.Client(
        base_url=f"{hub.url}/hub/api/gpulab",
        headers={"Authorization": f"token {token}"},
        timeout=90,
    )


def until(
    hub: Hub, client: httpx.Client, path: str, check: Any, what: str, timeout: float = 120
) -> dict[str, Any]:
    """The cluster at `path` once `check(model)` holds; fails at once when it ended, and after
    `timeout` seconds, with the cluster and its processes' logs."""
    deadline = time.monotonic() + timeout
    while True:
        model = client.get(path).json()
        if check(model):
            return dict(model)
        ended = model.get("state") in ("stopped", "failed")
        if ended or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {log.name}\n{log.read_text(errors='replace')[:2500]}"
                for log in sorted((hub.state_dir / "dask-clusters").rglob("*.log"))
            )
            raise AssertionError(f"waiting for {what}: {model}\n{logs}")
        time.sleep(0.3)


def cluster_processes(hub: Hub, user: str) -> list[psutil.Process]:
    """The owner's Dask processes (schedulers and workers), found by their account and command
    line; not her fork server, which runs no cluster (spawner/local/dask.py)."""
    uid = hub.account(user).pw_uid
    out = []
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if FORKSERVER_MODULE in cmdline:
            continue
        # by the modules they run, not by "dask" anywhere: the checkout's own path may say it (a
        # worktree named so), and then so would every server's command line
        if any(m in cmdline for m in ("distributed.", "singleuser.dask_", " -m dask ")):
            out.append(proc)
    return out


def dask_allocations(hub: Hub, cluster_id: int) -> set[str]:
    return {a for a in hub.allocations() if f"/dask-{cluster_id}-" in a}


async def compute_with(credentials: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from distributed import Client
    from distributed.security import Security

    security = Security(
        require_encryption=True,
        tls_ca_file=credentials["tls_cert"],
        tls_client_cert=credentials["tls_cert"],
        tls_client_key=credentials["tls_key"],
    )
    async with Client(
        credentials["scheduler_address"], security=security, asynchronous=True
    ) as client:
        import dask.array as da

        total = await client.compute(da.ones((2000, 2000), chunks=(500, 500)).sum())

        def environment() -> dict[str, str]:
            import os

            return dict(os.environ)

        envs = await client.run(environment)
    return int(total), envs


def test_a_notebooks_cluster_computes_on_its_shares_and_no_other_user_reaches_it(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")
    hub.start_server("bob", profile="cpu")
    alice = server_client(hub, "alice")
    r = alice.post(BASE.format(user="alice"), json={"profile": "gpu-quarter", "n_workers": 2})
    assert r.status_code == 201, r.text
    created = r.json()
    cid = created["id"]
    assert created["owner"] == "alice" and created["server"] == ""  # her server token's own
    assert created["dashboard_link"] == f"/hub/gpulab/dask/alice/{cid}/dashboard/status"
    path = f"{BASE.format(user='alice')}/{cid}"
    cluster = until(
        hub, alice, path, lambda m: m["workers_running"] == 2, "two workers", timeout=180
    )
    assert cluster["state"] == "running", cluster
    assert [w["share"] for w in cluster["workers"]] == ["1/4 GPU", "1/4 GPU"]
    assert sorted(dask_allocations(hub, cid)) == [
        f"alice/dask-{cid}-scheduler",
        f"alice/dask-{cid}-w1",
        f"alice/dask-{cid}-w2",
    ]
    r = alice.get(f"{path}/credentials")
    assert r.status_code == 200, r.text
    credentials = r.json()
    assert credentials["scheduler_address"].startswith("tls://")
    total, envs = asyncio.run(compute_with(credentials))
    assert total == 4_000_000
    gpus = {w["name"]: w["gpus"] for w in cluster["workers"]}
    assert len(envs) == 2
    for env in envs.values():
        # each worker sees exactly its own share of the GPU
        assert float(env[GPU_FRACTION_ENV]) == 0.25, env[GPU_FRACTION_ENV]
        assert [env["CUDA_VISIBLE_DEVICES"]] in gpus.values()
    listed = alice.get(BASE.format(user="alice")).json()["clusters"]
    assert [c["id"] for c in listed] == [cid]

    # bob's server token holds the dask scope on bob only: nothing of alice's, on any route
    bob = server_client(hub, "bob")
    for method, route, body in (
        ("GET", BASE.format(user="alice"), None),
        ("POST", BASE.format(user="alice"), {"profile": "gpu-quarter", "n_workers": 1}),
        ("GET", path, None),
        ("PATCH", path, {"n_workers": 0}),
        ("DELETE", path, None),
        ("GET", f"{path}/workers", None),
        ("GET", f"{path}/credentials", None),
    ):
        r = bob.request(method, route, json=body)
        assert r.status_code in (403, 404), (method, route, r.status_code, r.text)
        assert "tls_key" not in r.text
    # and under his own name her cluster is no cluster of his
    assert bob.get(f"{BASE.format(user='bob')}/{cid}").status_code == 404
    # an admin's service may read her clusters but never take her credentials
    assert hub.api("GET", f"/gpulab{path}").status_code == 200
    assert hub.api("GET", f"/gpulab{path}/credentials").status_code == 403

    # the dashboard through the hub: hers, not bob's
    dashboard = f"{hub.url}/hub/gpulab/dask/alice/{cid}/dashboard/status"
    page = httpx.get(dashboard, headers=alice.headers, timeout=60)
    assert page.status_code == 200, page.text[-2000:]
    assert "bokeh" in page.text.lower()
    assert cluster["scheduler_address"] not in page.text
    assert httpx.get(dashboard, headers=bob.headers, timeout=60).status_code in (403, 404)
    assert httpx.get(dashboard, timeout=60).status_code in (302, 403)  # nobody: no dashboard
    # a browser with the hub's login cookie (here the admin's, who holds `servers` on everyone)
    browser = hub.login("admin", hub.admin_password())
    page_in_browser = browser.get(f"/hub/gpulab/dask/alice/{cid}/dashboard/status")
    assert page_in_browser.status_code == 200 and "bokeh" in page_in_browser.text.lower()
    # its live panes are a websocket (Bokeh's), relayed by the hub
    token = re.search(r'"token"\s*:\s*"([^"]+)"', page.text) or re.search(
        r"token&#34;: &#34;([^&]+)&#34;", page.text
    )
    assert token is not None, page.text[:3000]
    asyncio.run(_bokeh_websocket(hub, cid, alice.headers["Authorization"], token.group(1)))

    r = alice.delete(path)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "stopped"
    assert cluster_processes(hub, "alice") == []  # nothing of it runs when DELETE answers
    assert dask_allocations(hub, cid) == set()  # every share is free again
    assert alice.get(f"{path}/credentials").status_code == 409


async def _bokeh_websocket(hub: Hub, cid: int, authorization: str, token: str) -> None:
    url = f"ws://127.0.0.1:{hub.port}/hub/gpulab/dask/alice/{cid}/dashboard/status/ws"
    request = HTTPRequest(url, headers={"Authorization": authorization}, connect_timeout=30)
    ws = await websocket_connect(request, subprotocols=["bokeh", token])
    try:
        assert ws.selected_subprotocol == "bokeh"
        first = await asyncio.wait_for(ws.read_message(), 30)
        assert first is not None  # Bokeh's ACK (its header frame)
        assert "ACK" in (first if isinstance(first, str) else first.decode(errors="replace"))
    finally:
        ws.close()


def test_beyond_quota_is_refused_whole_and_scaling_waits_for_a_free_share(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.create_user("bob")
    hub.start_server("alice", profile="cpu")
    hub.start_server("bob", profile="gpu-half")  # half of the only GPU is bob's
    alice = server_client(hub, "alice")
    base = BASE.format(user="alice")
    r = alice.post(base, json={"profile": "gpu-quarter", "n_workers": 5})
    assert r.status_code == 403, r.text
    message = r.json()["message"]
    assert message.startswith("n_workers: 5 workers of 0.25 GPU need 1.25 GPUs"), message
    assert "your GPU quota of 1 GPU" in message and "at most 4 workers" in message
    assert alice.get(base).json()["clusters"] == []  # nothing half-made
    assert not [a for a in hub.allocations() if "/dask-" in a]  # nothing held

    r = alice.post(base, json={"name": "etl", "profile": "gpu-quarter", "n_workers": 1})
    assert r.status_code == 201, r.text
    cid = r.json()["id"]
    path = f"{base}/{cid}"
    until(hub, alice, path, lambda m: m["workers_running"] == 1, "one worker")
    assert alice.post(base, json={"name": "etl", "profile": "cpu"}).status_code == 409
    r = alice.patch(path, json={"n_workers": 5})
    assert r.status_code == 403 and "at most 4 workers" in r.json()["message"], r.text
    # 3 workers fit her quota but only 2 fit the GPU (bob holds half): the third waits, saying why
    r = alice.patch(path, json={"n_workers": 3})
    assert r.status_code == 200 and r.json()["n_workers"] == 3, r.text
    model = until(
        hub,
        alice,
        path,
        lambda m: m["workers_running"] == 2 and m["waiting_reason"],
        "two running, one waiting",
    )
    assert model["waiting_reason"].startswith("waiting for a free 1/4 GPU"), model
    (pending,) = [w for w in model["workers"] if w["state"] == "pending"]
    assert pending["reason"] == model["waiting_reason"]
    # down to 1: the waiting worker goes first, then one running worker; its share is freed
    r = alice.patch(path, json={"n_workers": 1})
    assert r.status_code == 200, r.text
    model = until(
        hub,
        alice,
        path,
        lambda m: (
            m["workers_running"] == 1
            and not [w for w in m["workers"] if w["state"] in ("pending", "retiring")]
        ),
        "one worker left",
    )
    assert len(dask_allocations(hub, cid)) == 2  # the scheduler and one worker
    for bad, field in (
        ({"n_workers": -1}, "n_workers"),
        ({"n_workers": "3"}, "n_workers"),
        ({"keep_alive": "yes"}, "keep_alive"),
        ({"n_workers": 1, "keep_alive": True}, "keep_alive, n_workers"),
    ):
        r = alice.patch(path, json=bad)
        assert r.status_code == 400 and r.json()["message"].startswith(field), (bad, r.text)
    for bad, field in (
        ({"profile": "gpu-nope"}, "profile"),
        ({"profile": "gpu-quarter", "owner": "bob"}, "owner"),
        ({"profile": "gpu-quarter", "n_workers": 1, "keep_alvie": True}, "keep_alvie"),
        ({"profile": "gpu-quarter", "environment": {"CUDA_VISIBLE_DEVICES": "0"}}, "environment"),
        ({"profile": "gpu-8"}, "profile"),
    ):
        r = alice.post(base, json=bad)
        assert r.status_code == 400 and r.json()["message"].startswith(field), (bad, r.text)
    assert [c["id"] for c in alice.get(base).json()["clusters"]] == [cid]
    # a server's token speaks for its own server, whatever the body claims
    r = alice.post(base, json={"name": "cpu-only", "profile": "cpu", "server": "elsewhere"})
    assert r.status_code == 201 and r.json()["server"] == "", r.text
    assert alice.delete(f"{base}/{r.json()['id']}").json()["state"] == "stopped"
    assert alice.delete(path).json()["state"] == "stopped"


def test_a_cluster_stops_with_its_server_unless_kept_alive(make_hub: Any) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    alice = server_client(hub, "alice")
    base = BASE.format(user="alice")
    ids, pids = {}, {}
    for name, keep in (("goes", False), ("stays", True)):
        before = {p.pid for p in cluster_processes(hub, "alice")}
        body = {"name": name, "profile": "gpu-quarter", "n_workers": 1, "keep_alive": keep}
        r = alice.post(base, json=body)
        assert r.status_code == 201, r.text
        ids[name] = r.json()["id"]
        until(hub, alice, f"{base}/{ids[name]}", lambda m: m["workers_running"] == 1, "a worker")
        pids[name] = {p.pid for p in cluster_processes(hub, "alice")} - before
        assert pids[name], "its scheduler and worker run as alice"
    hub.stop_server("alice")
    admin = hub.client  # her server's token went with her server
    goes = f"/gpulab{base}/{ids['goes']}"
    model = admin.get(goes).json()
    deadline = time.monotonic() + 60  # nothing of it may run 60 s after its server stopped
    while model["state"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.5)
        model = admin.get(goes).json()
    assert model["state"] == "stopped", model
    assert model["reason"] == "stopped with its default server (not kept alive)"
    assert not [pid for pid in pids["goes"] if psutil.pid_exists(pid) and _alive(pid)]
    assert dask_allocations(hub, ids["goes"]) == set()
    stays = admin.get(f"/gpulab{base}/{ids['stays']}").json()
    assert stays["state"] == "running" and stays["workers_running"] == 1, stays
    # kept alive, it can be let go later (the sidebar's toggle), and stopped
    r = admin.patch(f"/gpulab{base}/{ids['stays']}", json={"keep_alive": False})
    assert r.status_code == 200 and r.json()["keep_alive"] is False, r.text
    r = admin.delete(f"/gpulab{base}/{ids['stays']}")
    assert r.json()["state"] == "stopped"
    assert cluster_processes(hub, "alice") == []
    assert not [a for a in hub.allocations() if "/dask-" in a]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_running_cluster_outlives_a_hub_restart_and_the_first_spawn_after_it(
    make_hub: Any,
) -> None:
    hub = make_hub(INVENTORY)
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    alice = server_client(hub, "alice")
    base = BASE.format(user="alice")
    r = alice.post(base, json={"profile": "gpu-quarter", "n_workers": 1, "keep_alive": True})
    assert r.status_code == 201, r.text
    cid = r.json()["id"]
    until(hub, alice, f"{base}/{cid}", lambda m: m["workers_running"] == 1, "a worker")
    pids = {p.pid for p in cluster_processes(hub, "alice")}
    hub.stop_hub()
    hub.start()
    # the first spawn reconciles allocations: the cluster's are kept, not taken for orphans
    hub.create_user("bob")
    hub.start_server("bob", profile="gpu-half")
    assert len(dask_allocations(hub, cid)) == 2
    admin = hub.client
    model = until(
        hub,
        admin,
        f"/gpulab{base}/{cid}",
        lambda m: m["state"] == "running" and m["workers_running"] == 1,
        "the cluster, watched again",
    )
    assert [w["name"] for w in model["workers"]] == ["w1"]  # the same worker, not a new one
    assert {p.pid for p in cluster_processes(hub, "alice")} == pids
    # scaled after the restart: the monitor and admission work again
    r = admin.patch(f"/gpulab{base}/{cid}", json={"n_workers": 2})
    assert r.status_code == 200, r.text
    until(hub, admin, f"/gpulab{base}/{cid}", lambda m: m["workers_running"] == 2, "w2")
    assert admin.delete(f"/gpulab{base}/{cid}").json()["state"] == "stopped"
    assert cluster_processes(hub, "alice") == []
