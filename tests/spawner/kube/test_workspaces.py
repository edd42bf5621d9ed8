"""Workspaces of GPUKubeSpawner in a real hub on the real dev cluster: a home PVC per server,
kernel variables that come back (asked for, or by themselves after a preemption), VolumeSnapshots
listed, restored and cloned through the hub's REST API.

Pods run as processes of this machine's Python environment (the node agent ignores images), so
the kernels load gpulab's real checkpoint extension from the home the pod prepared itself."""

from __future__ import annotations

import asyncio
import base64
import urllib.error
from pathlib import Path

import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from gpulab.spawner.workspaces.kube import KEY_FILE
from tests.harness.hub import Hub, merged, run_in_kernel
from tests.harness.kube import (
    KUBE_WORKSPACE_OVERLAY,
    SPAWNER_NODES,
    kube_hub_overlay,
    placed_pod_of,
    placed_pods,
)
from tests.harness.wait import wait_for
from tests.harness.workspace_contract import check_workspace_contract

SET_VARIABLES = """
import os, sys
losses = [0.9, 0.5, 0.25]
config = {"lr": 3e-4, "layers": 12}
site = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p.startswith(os.environ["HOME"])][0]
os.makedirs(site, exist_ok=True)
with open(os.path.join(site, "gpulab_probe_pkg.py"), "w") as f:  # what `pip install` leaves
    f.write("VERSION = '1.2.3'\\n")
with open(os.path.expanduser("~/notes.txt"), "w") as f:
    f.write("epoch 7\\n")
print("HOME", os.environ["HOME"], os.getcwd())
"""

READ_VARIABLES = "print('losses', losses, 'config', config)"

# the kernel's own key file, and how many environments of the pod's processes hold the key
READ_KEY_AND_ENVIRONMENTS = """
import os
key = open(os.environ["GPULAB_CHECKPOINT_KEY_FILE"]).read().strip()
holding = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        holding += key.encode() in open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        pass
print("key", key, "environments-with-key", holding)
"""

# a TCP connection to host:port from the kernel
CONNECT = """
import socket
host, port = {target!r}.rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=5).close()
    print({target!r}, "open")
except ConnectionRefusedError:
    print({target!r}, "refused")
"""

# another user's key at the node's copy of their Secret volume, and at the mount path
READ_OTHER_KEY = """
import os
for path in {paths!r}:
    try:
        print(path, "read", open(path).read())
    except OSError as e:
        print(path, "refused", e.errno)
"""


def _snapshots(hub: Hub, user: str) -> list[dict]:
    r = hub.api("GET", f"/gpulab/users/{user}/snapshots")
    assert r.status_code == 200, r.text
    return r.json()["snapshots"]


def _claim_of(pod: dict) -> str:
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "gpulab-home"]
    return vol["persistentVolumeClaim"]["claimName"]


def _env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def _pvc_exists(cluster: DevCluster, name: str) -> bool:
    """A claim that is gone, or deleted and waiting on its `pvc-protection` finalizer (which the
    controller manager removes once no pod uses it, a moment after the delete), does not exist."""
    try:
        pvc = cluster.api("GET", f"/api/v1/namespaces/default/persistentvolumeclaims/{name}")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise
    return not pvc["metadata"].get("deletionTimestamp")


@pytest.fixture(scope="module")
def cluster(make_dev_cluster) -> DevCluster:
    return make_dev_cluster(SPAWNER_NODES, "gk-ws-cluster")


@pytest.fixture
def ws_hub(make_hub, cluster: DevCluster) -> Hub:
    return make_hub(
        kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY),
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )


async def test_kernel_variables_files_and_packages_survive_a_restart_of_a_kube_server(
    ws_hub, cluster
):
    hub = ws_hub
    hub.create_user("ada")
    model = hub.start_server("ada", profile="cpu")
    assert model["state"]["pvc_name"] == "gpulab-home-ada"
    pod = placed_pod_of(cluster, "ada")
    assert _claim_of(pod) == "gpulab-home-ada"
    container = pod["spec"]["containers"][0]
    assert container["args"][1:5] == [
        "-m",
        "gpulab.spawner.singleuser.checkpoint.prepare",
        "--home",
        "/home/jovyan",
    ]
    assert {"name": "gpulab-home", "mountPath": "/home/jovyan"} in container["volumeMounts"]
    env = _env_of(pod)
    assert env["HOME"] == "/home/jovyan"
    assert env["GPULAB_CHECKPOINT_DIR"] == "/home/jovyan/.gpulab/checkpoints/default"
    assert env["GPULAB_CHECKPOINT_USER"] == "ada"
    # the signing key is neither in the pod spec nor in an environment: the pod names a file of
    # the user's Secret, mounted read-only (0440, group-owned by the pod's fsGroup)
    assert "GPULAB_CHECKPOINT_KEY" not in env
    assert env["GPULAB_CHECKPOINT_KEY_FILE"] == "/etc/gpulab/checkpoint-key/key"
    (key_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "gpulab-checkpoint-key"]
    assert key_volume["secret"] == {
        "secretName": "gpulab-checkpoint-key-ada",
        "items": [{"key": "key", "path": "key"}],
        "defaultMode": 0o440,
    }
    assert {
        "name": "gpulab-checkpoint-key",
        "mountPath": "/etc/gpulab/checkpoint-key",
        "readOnly": True,
    } in container["volumeMounts"]
    secret = cluster.api("GET", "/api/v1/namespaces/default/secrets/gpulab-checkpoint-key-ada")
    assert secret["metadata"]["labels"]["hub.jupyter.org/username"] == "ada"
    key_hex = base64.b64decode(secret["data"]["key"]).decode()
    assert len(bytes.fromhex(key_hex)) == 32
    assert "GPULAB_AUTO_RESTORE" not in env
    # the kernel (uid 1000) reads it from the file; no process of the pod has it in its environment
    out = await run_in_kernel(hub, "ada", READ_KEY_AND_ENVIRONMENTS)
    assert f"key {key_hex} environments-with-key 0" in out

    out = await run_in_kernel(hub, "ada", SET_VARIABLES)
    assert "HOME /home/jovyan /home/jovyan" in out
    hub.stop_server("ada")
    (on_stop,) = _snapshots(hub, "ada")
    assert on_stop["label"] == "on-stop" and on_stop["files"] >= 3 and on_stop["bytes"] > 0
    # the hub reads the kernel checkpoint in the volume (a hostPath PV here) for its offer
    kernels = hub.api("GET", "/gpulab/users/ada/snapshots").json()["kernels"]
    assert [k["notebook"] for k in kernels] == ["default"] and kernels[0]["variables"] >= 2

    hub.start_server("ada", profile="cpu")
    assert _claim_of(placed_pod_of(cluster, "ada")) == "gpulab-home-ada"  # the same home again
    out = await run_in_kernel(
        hub,
        "ada",
        "%gpulab_restore\n"
        "import gpulab_probe_pkg, os\n"
        "print('pkg', gpulab_probe_pkg.VERSION, open(os.path.expanduser('~/notes.txt')).read())\n"
        + READ_VARIABLES,
    )
    assert "pkg 1.2.3 epoch 7" in out
    assert "losses [0.9, 0.5, 0.25] config {'lr': 0.0003, 'layers': 12}" in out
    hub.stop_server("ada")
    assert [s["label"] for s in _snapshots(hub, "ada")] == ["on-stop", "on-stop"]


async def test_a_preempted_server_gets_its_kernel_variables_back_by_itself(ws_hub, cluster):
    hub = ws_hub
    hub.create_user("spot")
    hub.create_user("dora")
    hub.start_server("spot", profile="a100-spot-8")
    out = await run_in_kernel(
        hub,
        "spot",
        "losses = [0.9, 0.5, 0.25]\nconfig = {'lr': 3e-4}\nprint('set')",
        keep_kernel=True,
    )
    assert "set" in out

    hub.start_server("dora", profile="a100-1")  # on demand: evicts spot's preemptible server
    wait_for("the preempted server to be gone", lambda: hub.server_model("spot") is None, 60)
    labels = [s["label"] for s in _snapshots(hub, "spot")]
    assert labels == ["preempted"]
    hub.stop_server("dora")

    hub.start_server("spot", profile="a100-spot-8")
    assert _env_of(placed_pod_of(cluster, "spot"))["GPULAB_AUTO_RESTORE"] == "1"
    out = await run_in_kernel(hub, "spot", "print('losses', losses, 'config', config)")
    assert "losses [0.9, 0.5, 0.25] config {'lr': 0.0003}" in out
    hub.stop_server("spot")
    # once: the next start asks again
    hub.start_server("spot", profile="a100-spot-8")
    assert "GPULAB_AUTO_RESTORE" not in _env_of(placed_pod_of(cluster, "spot"))
    hub.stop_server("spot")


async def test_snapshots_are_listed_restored_and_cloned_over_the_rest_api(ws_hub, cluster):
    hub = ws_hub
    hub.create_user("cleo")
    hub.create_user("eve")
    url = "/gpulab/users/cleo/snapshots"
    hub.start_server("cleo", profile="cpu")
    await run_in_kernel(hub, "cleo", "open('/home/jovyan/data.csv', 'w').write('a,b\\n1,2\\n')")
    hub.stop_server("cleo")
    hub.start_server("cleo", profile="cpu")
    await run_in_kernel(hub, "cleo", "import os; os.remove('/home/jovyan/data.csv')")
    r = hub.api("POST", url)  # on demand, while it runs
    assert r.status_code == 201 and r.json()["label"] == "on-demand", r.text
    listing = _snapshots(hub, "cleo")
    good = listing[-1]
    assert [s["label"] for s in listing] == ["on-demand", "on-stop"]
    r = hub.api("POST", f"{url}/{good['id']}/restore")
    assert r.status_code == 409, r.text
    assert "while the default server uses it: stop that server first" in r.json()["message"]
    hub.stop_server("cleo")

    token = hub.api("POST", "/users/eve/tokens", json={"note": "test"}).json()["token"]
    eve = {"Authorization": f"token {token}"}
    assert hub.client.get(url, headers=eve).status_code == 403
    assert hub.client.post(f"{url}/{good['id']}/restore", headers=eve).status_code == 403
    assert hub.api("POST", f"{url}/no-such-snapshot/restore").status_code == 404

    r = hub.api("POST", f"{url}/{good['id']}/restore")
    assert r.status_code == 200, r.text
    assert r.json()["restored"] == good["id"] and r.json()["before_restore"]
    assert not _pvc_exists(cluster, "gpulab-home-cleo")  # replaced by the restored claim
    hub.start_server("cleo", profile="cpu")
    claim = _claim_of(placed_pod_of(cluster, "cleo"))
    assert claim.startswith("gpulab-home-cleo-")
    assert hub.server_model("cleo")["state"]["pvc_name"] == claim
    out = await run_in_kernel(hub, "cleo", "print(open('/home/jovyan/data.csv').read())")
    assert "a,b\n1,2" in out
    hub.stop_server("cleo")
    labels = [s["label"] for s in _snapshots(hub, "cleo")]
    assert labels[:2] == ["on-stop", "before-restore"]

    r = hub.api("POST", f"{url}/{good['id']}/clone", json={"name": "exp"})
    assert r.status_code == 201, r.text
    hub.start_server("cleo", "exp")
    (exp_pod,) = [p for p in placed_pods(cluster) if p["metadata"]["name"].endswith("cleo--exp")]
    assert _claim_of(exp_pod) == "gpulab-home-cleo--exp"
    out = await run_in_kernel(
        hub, "cleo", "print(open('/home/jovyan/data.csv').read())", server="exp"
    )
    assert "a,b\n1,2" in out
    hub.stop_server("cleo", "exp")

    # the picker's one-shot choice: start from a snapshot (the on-demand one lacks the file)
    on_demand = next(s for s in _snapshots(hub, "cleo") if s["label"] == "on-demand")
    r = hub.spawn("cleo", profile="cpu", restore_snapshot=on_demand["id"])
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("cleo")
    out = await run_in_kernel(hub, "cleo", "import os; print('has', os.path.exists('data.csv'))")
    assert "has False" in out
    hub.stop_server("cleo")
    r = hub.spawn("cleo", profile="cpu", restore_snapshot="no-such-snapshot")
    assert r.status_code == 400 and "No snapshot 'no-such-snapshot'" in r.json()["message"]


async def test_a_running_kube_server_is_snapshotted_on_a_schedule(make_hub, cluster):
    hub = make_hub(
        merged(
            kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY),
            Config({"GPUKubeSpawner": {"snapshot_interval_seconds": 2}}),
        ),
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )
    hub.create_user("sam")
    hub.start_server("sam", profile="cpu")
    await run_in_kernel(hub, "sam", "open('/home/jovyan/draft.txt', 'w').write('v1')")
    wait_for(
        "a scheduled snapshot",
        lambda: "scheduled" in [s["label"] for s in _snapshots(hub, "sam")],
        60,
    )
    hub.stop_server("sam")
    labels = [s["label"] for s in _snapshots(hub, "sam")]
    assert labels[0] == "on-stop" and "scheduled" in labels
    await asyncio.sleep(5)  # more than two intervals: the schedule ended with the server
    assert [s["label"] for s in _snapshots(hub, "sam")] == labels


def _volume_dir(cluster: DevCluster, claim: str) -> Path:
    pvc = cluster.api("GET", f"/api/v1/namespaces/default/persistentvolumeclaims/{claim}")
    pv = cluster.api("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    return Path(pv["spec"]["hostPath"]["path"])


async def test_a_server_lost_with_its_node_gets_its_kernel_variables_back_by_itself(
    ws_hub, cluster
):
    hub = ws_hub
    hub.create_user("tess")
    hub.start_server("tess", profile="t4-1")
    assert placed_pod_of(cluster, "tess")["spec"]["nodeName"] == "gk-t4"
    await run_in_kernel(hub, "tess", "weights = {'w': [1, 2, 3]}\nprint('set')", keep_kernel=True)
    # the kernel saves after each cell; the node's failure kills it without a chance to save
    manifest = _volume_dir(cluster, "gpulab-home-tess") / ".gpulab/checkpoints/default/default"
    wait_for("the kernel's checkpoint", lambda: (manifest / "manifest.json").exists(), 30)
    cluster.stop_node("gk-t4")
    try:
        wait_for(
            "the hub to notice tess's server is lost", lambda: hub.server_model("tess") is None, 120
        )
        assert [s["label"] for s in _snapshots(hub, "tess")] == ["node-lost"]
    finally:
        cluster.start_node("gk-t4")
        wait_for("gk-t4 Ready again", lambda: hub.capacity()["t4-1"]["free"] == 1, 120)
    hub.start_server("tess", profile="t4-1")
    assert _env_of(placed_pod_of(cluster, "tess"))["GPULAB_AUTO_RESTORE"] == "1"
    out = await run_in_kernel(hub, "tess", "print('weights', weights)")
    assert "weights {'w': [1, 2, 3]}" in out
    hub.stop_server("tess")


async def test_a_user_cannot_read_another_users_checkpoint_key_or_home(ws_hub, cluster):
    hub = ws_hub
    hub.create_user("ivy")
    hub.create_user("mal")
    hub.start_server("ivy", profile="cpu")
    hub.start_server("mal", profile="cpu")
    victim = placed_pod_of(cluster, "ivy")
    meta = victim["metadata"]
    pod_dir = cluster.state_dir / "agent" / "pods" / f"default_{meta['name']}_{meta['uid'][:8]}"
    key_on_node = pod_dir / "volumes" / "gpulab-checkpoint-key" / "key"
    home_on_node = _volume_dir(cluster, _claim_of(victim))
    # a file the victim's server prepared in its home; there, for the node's root
    home_file = next(p for p in sorted(home_on_node.rglob("*")) if p.is_file())
    assert key_on_node.is_file()
    own_key = base64.b64decode(
        cluster.api("GET", "/api/v1/namespaces/default/secrets/gpulab-checkpoint-key-mal")["data"][
            "key"
        ]
    ).decode()
    paths = [str(key_on_node), str(home_file), KEY_FILE]
    out = await run_in_kernel(hub, "mal", READ_OTHER_KEY.format(paths=paths))
    # mal's pod runs as the same uid 1000 / fsGroup 100 as ivy's: what keeps them apart is that
    # nothing of ivy's is mounted in mal's pod and the node keeps its copies root-only
    assert f"{key_on_node} refused 13" in out
    assert f"{home_file} refused 13" in out
    assert f"{KEY_FILE} read {own_key}" in out  # at the mount path: mal's own key, nobody else's
    # nor can mal's kernel reach ivy's server: the servers' NetworkPolicy admits only the hub
    # and proxy (the dev cluster's node agent enforces it)
    ivy_server = f"{victim['status']['podIP']}:8888"
    out = await run_in_kernel(hub, "mal", CONNECT.format(target=ivy_server))
    assert f"{ivy_server} refused" in out
    hub.stop_server("ivy")
    hub.stop_server("mal")


async def test_the_kube_backend_keeps_the_workspace_contract(ws_hub):
    # the scenario tests/spawner/workspaces/test_contract.py runs on the local backend
    await check_workspace_contract(ws_hub, "dora", profile="cpu")


def _keep_container_log(cluster: DevCluster, pod: dict, keep: Path) -> Path:
    """A hard link to the server container's log on the node, which lives on after the agent
    removes the pod's directory (the preStop hook's output goes there, as exec output does on
    the dev cluster's node)."""
    meta = pod["metadata"]
    container = pod["spec"]["containers"][0]["name"]
    pod_dir = cluster.state_dir / "agent" / "pods" / f"default_{meta['name']}_{meta['uid'][:8]}"
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.unlink(missing_ok=True)
    keep.hardlink_to(pod_dir / f"{container}.log")
    return keep


async def test_the_prestop_save_alone_brings_back_the_last_cell_after_a_preemption(
    make_hub, cluster
):
    # per-cell saves off in the pod (a 0 MB incremental limit): nothing of the cell is saved
    # until the pod stops
    overlay = kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY)
    overlay.Spawner.environment.update({"GPULAB_CHECKPOINT_INCREMENTAL_MB": "0"})
    hub = make_hub(overlay, env={"KUBECONFIG": str(cluster.kubeconfig)}, name="final-save")
    hub.create_user("pia")
    hub.create_user("dan")
    hub.start_server("pia", profile="a100-spot-8")
    pod = placed_pod_of(cluster, "pia")
    assert _env_of(pod)["GPULAB_CHECKPOINT_INCREMENTAL_MB"] == "0"
    log = _keep_container_log(cluster, pod, cluster.state_dir / "kept-logs" / "pia.log")
    try:
        cell = "epoch = 7\nlast = 'set in the last cell before eviction'\nprint('ok')"
        assert "ok" in await run_in_kernel(hub, "pia", cell, keep_kernel=True)
        hub.start_server("dan", profile="a100-1")  # on demand: evicts pia's preemptible server
        wait_for("the preempted server to be gone", lambda: hub.server_model("pia") is None, 60)
        hub.stop_server("dan")
        # the preStop hook's SIGTERM made the kernel save and exit before the server itself was
        # told to stop (the server's own kernel shutdown, which saves too, came too late for it)
        assert "gpulab prestop: 1 of 1 kernels saved and exited" in log.read_text(), log.read_text()
    finally:
        log.unlink(missing_ok=True)
    hub.start_server("pia", profile="a100-spot-8")
    out = await run_in_kernel(hub, "pia", "print(epoch, '|', last)")
    assert "7 | set in the last cell before eviction" in out
    hub.stop_server("pia")
