"""gpulab.dask.GPUCluster from real kernels of real single-user servers, through a real hub (its
cluster service, the local executor's scheduler and worker processes under the user's account):
a cluster computes and leaves nothing once closed; a cluster made on one server is found by name
and listed from another of the same user; a quota refusal reads as the hub wrote it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from traitlets.config import Config

from gpulab.spawner.local.dask import FORKSERVER_MODULE
from tests.harness.hub import Hub, merged, run_in_kernel
from tests.harness.jobs import INVENTORY
from tests.harness.labserver import EXTENSION_SRC

pytestmark = pytest.mark.slow


def dask_overlay(**capacity: Any) -> Config:
    overlay = Config()
    overlay.Spawner.environment.update({"PYTHONPATH": str(EXTENSION_SRC)})
    if capacity:
        overlay.GPUCapacity.update(capacity)
    return merged(INVENTORY, overlay)


def hub_clusters(hub: Hub, user: str) -> list[dict[str, Any]]:
    r = hub.api("GET", f"/gpulab/users/{user}/dask-clusters")
    assert r.status_code == 200, r.text
    return list(r.json()["clusters"])


def dask_allocations(hub: Hub, user: str) -> list[str]:
    return [a for a in hub.allocations() if a.startswith(f"{user}/dask-")]


def processes_of(uid: int, word: str) -> list[str]:
    """Command lines of `uid`'s processes that mention `word` (the cluster's leftovers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if word in cmdline:
            found.append(cmdline)
    return found


def result_line(out: str, key: str) -> Any:
    for line in out.splitlines():
        if line.startswith(key + " "):
            return json.loads(line[len(key) + 1 :])
    raise AssertionError(f"no {key} in the kernel's output:\n{out}")


COMPUTE = """
import json
from distributed import Client
from gpulab.dask import GPUCluster, list_clusters
cluster = GPUCluster(profile="gpu-quarter", n_workers=2, name="e2e")
client = Client(cluster)
client.wait_for_workers(2, timeout=180)
futures = client.map(lambda x: x * x, range(100))
print("TOTAL", json.dumps(client.submit(sum, futures).result()))
print("WORKERS", json.dumps(sorted(w["name"] for w in client.scheduler_info()["workers"].values())))
print("LISTED", json.dumps([c.name for c in list_clusters()]))
print("DASHBOARD", json.dumps(cluster.dashboard_link))
client.close()
cluster.close()
print("STATE", json.dumps(cluster.info.state))
"""


async def test_a_kernels_gpucluster_computes_and_leaves_nothing(make_hub: Any) -> None:
    hub = make_hub(dask_overlay())
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    out = await run_in_kernel(hub, "alice", COMPUTE, timeout=300)
    assert result_line(out, "TOTAL") == sum(x * x for x in range(100))
    assert len(result_line(out, "WORKERS")) == 2
    assert "e2e" in result_line(out, "LISTED")
    assert result_line(out, "DASHBOARD").endswith("/hub/gpulab/dask/alice/1/dashboard/status")
    assert result_line(out, "STATE") == "stopped"
    (cluster,) = hub_clusters(hub, "alice")
    assert cluster["state"] == "stopped" and cluster["server"] == ""
    assert dask_allocations(hub, "alice") == []
    # no scheduler or worker is left; alice's fork server (no share, no cluster) may be, until
    # it has been idle for a minute (spawner/local/dask.py)
    left = processes_of(hub.account("alice").pw_uid, "dask")
    assert [c for c in left if FORKSERVER_MODULE not in c] == []
    # the cluster's key, config and spill are gone with it; its logs stay
    folder = hub.state_dir / "dask-clusters" / "cluster-1"
    kept = {p.name for p in folder.iterdir() if not p.name.endswith(".ended-by")}
    assert kept == {"scheduler.log", "w1.log", "w2.log"}


FROM_NAME = """
import json
from gpulab.dask import GPUCluster, list_clusters
print("LISTED", json.dumps([[c.name, c.server, c.state] for c in list_clusters()]))
cluster = GPUCluster.from_name("shared")
client = cluster.get_client()
client.wait_for_workers(1, timeout=180)
print("TOTAL", json.dumps(client.submit(lambda: 6 * 7).result()))
client.close()
cluster.shutdown()
print("STATE", json.dumps(cluster.info.state))
"""


async def test_a_cluster_is_found_by_name_and_listed_from_another_server(make_hub: Any) -> None:
    hub = make_hub(dask_overlay())
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    hub.start_server("alice", "two", profile="cpu")
    made = await run_in_kernel(
        hub,
        "alice",
        "from gpulab.dask import GPUCluster\n"
        "c = GPUCluster(profile='gpu-quarter', n_workers=1, name='shared', keep_alive=True)\n"
        "print('MADE', c.info.id)\n"
        "c.close()\n",  # kept alive: close() disconnects only
        timeout=300,
    )
    assert "MADE" in made, made
    out = await run_in_kernel(hub, "alice", FROM_NAME, server="two", timeout=300)
    assert ["shared", "", "running"] in result_line(out, "LISTED")
    assert result_line(out, "TOTAL") == 42
    assert result_line(out, "STATE") == "stopped"
    assert dask_allocations(hub, "alice") == []


QUOTA = """
from gpulab.dask import GPUCluster, DaskQuotaError
try:
    GPUCluster(profile="gpu-1", n_workers=3)
except DaskQuotaError as e:
    print("REFUSED", e.status, e)
"""


async def test_a_quota_refusal_reads_as_the_hub_wrote_it(make_hub: Any) -> None:
    hub = make_hub(dask_overlay(default_user_quota_gpus=1))
    hub.create_user("alice")
    hub.start_server("alice", profile="cpu")
    out = await run_in_kernel(hub, "alice", QUOTA, timeout=120)
    line = next(ln for ln in out.splitlines() if ln.startswith("REFUSED 403 "))
    message = line[len("REFUSED 403 ") :]
    # the same request through the REST API, with the server's own token: the same words
    token = hub.server_env("alice")["JUPYTERHUB_API_TOKEN"]
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(
            f"{hub.url}/hub/api/gpulab/users/alice/dask-clusters",
            headers={"Authorization": f"token {token}"},
            json={"profile": "gpu-1", "n_workers": 3, "keep_alive": False},
        )
    assert r.status_code == 403 and r.json()["message"] == message, (r.text, message)
    assert "quota" in message.lower()
    assert hub_clusters(hub, "alice") == []  # nothing half-made
    assert dask_allocations(hub, "alice") == []
