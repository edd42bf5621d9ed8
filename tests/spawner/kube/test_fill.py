"""Fill each sharing backend's devices through GPUKubeSpawner on the dev cluster: the spawns the
devices hold start, the next get a 409 before any pod exists, and no pod is left Pending. Then
quotas and on-demand headroom on the Kubernetes backend, through the spawner."""

from __future__ import annotations

import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from tests.harness.hub import merged
from tests.harness.kube import SPAWNER_NODES, placed_pods
from tests.harness.kube_fill import BACKENDS, backend_overlay, fill


@pytest.fixture(scope="module")
def cluster(make_dev_cluster) -> DevCluster:
    return make_dev_cluster(SPAWNER_NODES, "gk-fill")


@pytest.mark.parametrize(("sharing", "profile", "node", "slots"), BACKENDS)
def test_a_full_backend_refuses_the_next_spawn_with_409_and_leaves_no_pod_pending(
    make_hub, cluster, sharing, profile, node, slots
):
    hub = make_hub(
        backend_overlay(sharing), env={"KUBECONFIG": str(cluster.kubeconfig)}, name=sharing
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
        backend_overlay("time-slicing"),
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
    overlay = merged(backend_overlay("mig"), Config({"GPUCapacity": {"headroom_fraction": 0.5}}))
    hub = make_hub(overlay, env={"KUBECONFIG": str(cluster.kubeconfig)}, name="headroom")
    hub.create_user("sam")
    r = hub.spawn("sam", profile="a100-spot-8")
    assert r.status_code == 409, r.text
    assert "kept for on-demand servers" in r.json()["message"]
    assert hub.server_model("sam") is None and not hub.allocations()
