"""Fill each sharing backend's devices through GPUKubeSpawner on the dev cluster: the spawns the
devices hold start, the next get a 409 before any pod exists, and no pod is left Pending. Then
quotas and on-demand headroom on the Kubernetes backend, through the spawner."""

from __future__ import annotations

import json

import httpx
import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from tests.harness.hub import merged
from tests.harness.kube import SPAWNER_NODES, placed_pods
from tests.harness.kube_fill import BACKENDS, backend_overlay, fill
from tests.harness.labserver import EXTENSION_SRC


@pytest.fixture(scope="module")
def cluster(make_dev_cluster) -> DevCluster:
    return make_dev_cluster(SPAWNER_NODES, "gk-fill")


@pytest.mark.parametrize(("sharing", "profile", "node", "slots"), BACKENDS)
def test_a_full_backend_refuses_the_next_spawn_with_409_and_leaves_no_pod_pending(
    make_hub, cluster, sharing, profile, node, slots
):
    hub = make_hub(
        backend_overlay(sharing, cluster), env={"KUBECONFIG": str(cluster.kubeconfig)}, name=sharing
    )
    result = fill(hub, cluster, sharing, profile, slots)
    assert not result.other, result.other
    assert len(result.started) == slots, (result.started, result.refused)
    assert result.overadmitted == 0
    assert len(result.refused) == 2
    assert all("cannot start now" in m for m in result.refused.values()), result.refused
    assert not result.refused_with_pod and not result.pending_pods
    assert result.nodes == {node}
    assert hub.capacity()[profile]["free"] == 0
    # the next share is there again once one server stops
    hub.stop_server(result.started[0])
    assert hub.capacity()[profile]["free"] == 1


def test_quota_counts_what_was_asked_on_the_kubernetes_backend(make_hub, cluster):
    overlay = merged(
        backend_overlay("time-slicing", cluster),
        Config({"GPUCapacity": {"user_quota_gpus": {"quinn": "1/4"}}}),
    )
    hub = make_hub(overlay, env={"KUBECONFIG": str(cluster.kubeconfig)}, name="quota")
    hub.create_user("quinn")
    hub.start_server("quinn", "a", profile="a100-eighth")
    hub.start_server("quinn", "b", profile="a100-eighth")  # 1/8 + 1/8: exactly the quota
    r = hub.spawn("quinn", "c", profile="a100-eighth")
    assert r.status_code == 403, r.text
    assert r.json()["message"].startswith("GPU quota exceeded: User 'quinn' asks for 0.125 GPU")
    assert set(hub.allocations()) == {"quinn/a", "quinn/b"}
    # each replica holds a quarter of its GPU's time: the allocation says so, the quota counts 1/8
    assert {a["gpus"][0]["milli"] for a in hub.allocations().values()} == {250}
    owners = [
        p["metadata"]["annotations"]["hub.jupyter.org/username"] for p in placed_pods(cluster)
    ]
    assert owners.count("quinn") == 2  # the refused spawn made no pod


def test_preemptible_work_stays_out_of_the_on_demand_headroom(make_hub, cluster):
    overlay = merged(
        backend_overlay("mig", cluster), Config({"GPUCapacity": {"headroom_fraction": 0.5}})
    )
    hub = make_hub(overlay, env={"KUBECONFIG": str(cluster.kubeconfig)}, name="headroom")
    hub.create_user("sam")
    r = hub.spawn("sam", profile="a100-spot-8")
    assert r.status_code == 409, r.text
    assert "kept for on-demand servers" in r.json()["message"]
    assert hub.server_model("sam") is None and not hub.allocations()


@pytest.mark.parametrize(
    ("sharing", "profile", "name", "limit"),
    [
        ("mig", "a100-quarter", "Simulated NVIDIA A100-SXM4-80GB MIG 2g.20gb", 20480),
        ("time-slicing", "a100-eighth", "Simulated NVIDIA A100-SXM4-80GB", 20480),
    ],
)
def test_a_pod_monitor_shows_its_own_share(
    make_hub, cluster, tmp_path, sharing, profile, name, limit
):
    """The monitor in the pod reports the share the hub placed: a MIG instance's own memory, a
    time-slicing replica's part of the GPU (a 1/8 request holds a 1/4 replica), simulated and
    labelled so on the dev cluster's nodes."""
    enable = tmp_path / "jupyter-config" / "jupyter_server_config.d" / "jupyterlab_gpulab.json"
    enable.parent.mkdir(parents=True)
    enable.write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {"jupyterlab_gpulab": True}}})
    )
    for path in (tmp_path, *enable.parents[:3]):
        path.chmod(0o755)  # the pod runs as its own uid
    enable.chmod(0o644)
    overlay = backend_overlay(sharing, cluster)
    overlay.Spawner.environment.update(
        {"PYTHONPATH": str(EXTENSION_SRC), "JUPYTER_CONFIG_PATH": str(enable.parents[1])}
    )
    hub = make_hub(overlay, env={"KUBECONFIG": str(cluster.kubeconfig)}, name=f"mon-{sharing}")
    hub.create_user("mona")
    hub.start_server("mona", profile=profile)
    r = httpx.get(
        f"{hub.url}/user/mona/gpulab/monitor/devices",
        headers={"Authorization": f"token {hub.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["simulated"] and body["share"]["fraction"] == 0.25
    assert body["share"]["memory_limit_mib"] == limit
    (device,) = body["devices"]
    assert device["name"] == name and device["memory_limit_mib"] == limit
    assert not device["whole"]
