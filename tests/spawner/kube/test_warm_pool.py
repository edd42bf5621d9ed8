"""The Kubernetes warm pool (warm capacity) in a real hub against the real dev-cluster control
plane: each member a placeholder pod holding its reservation on the node a server of its profile
would run on; a start of that profile takes the member's node and devices with a pod of its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from gpulab.hub.warmpool import WARM_POOL_OWNER
from gpulab.spawner.names import PLACEMENT_ANNOTATION, WARM_MEMBER_LABEL
from tests.harness.hub import Hub, merged
from tests.harness.kube import KUBE_HUB_OVERLAY, SPAWNER_NODES, kube_hub_overlay, placed_pod_of
from tests.harness.wait import wait_for

POOL = Config(
    {
        "GPUWarmPool": {
            "pools": [{"profile": "a100-1", "min": 1, "max": 1}],
            "check_interval_seconds": 1,
        },
        "JupyterHub": {"authenticate_prometheus": False},  # the claim counter on /hub/metrics
    }
)


@pytest.fixture(scope="module")
def cluster(make_dev_cluster) -> DevCluster:
    return make_dev_cluster(SPAWNER_NODES, "gw-cluster")


@pytest.fixture(autouse=True)
def no_member_pods_left(cluster: DevCluster) -> Any:
    """After each test (its hubs stopped first): member pods outlive a hub by design (the next
    hub sweeps them), so delete them here and wait until they are gone."""
    yield
    for pod in member_pods(cluster):
        name = pod["metadata"]["name"]
        cluster.api("DELETE", f"/api/v1/namespaces/default/pods/{name}", {"gracePeriodSeconds": 0})
    wait_for("no member pods", lambda: not member_pods(cluster), 60)


@pytest.fixture
def warm_hub(make_hub, cluster: DevCluster) -> Hub:
    return _hub(make_hub, cluster)


def _hub(make_hub: Any, cluster: DevCluster) -> Hub:
    return make_hub(
        kube_hub_overlay(cluster, merged(KUBE_HUB_OVERLAY, POOL)),
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )


def member_pods(cluster: DevCluster) -> list[dict[str, Any]]:
    path = f"/api/v1/namespaces/default/pods?labelSelector={WARM_MEMBER_LABEL}%3Dtrue"
    return list(cluster.api("GET", path)["items"])


def running_member(cluster: DevCluster, other_than: str = "") -> dict[str, Any]:
    """The one member pod, Running on its node (and not named `other_than`)."""

    def check() -> dict[str, Any] | None:
        pods = [p for p in member_pods(cluster) if p["metadata"]["name"] != other_than]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        if len(live) == 1 and live[0].get("status", {}).get("phase") == "Running":
            return live[0]
        return None

    return wait_for("a Running warm member pod", check, 120)


def placement_of(pod: dict[str, Any]) -> dict[str, Any]:
    return json.loads(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])


def claimed_total(hub: Hub, slug: str) -> float | None:
    text = httpx.get(f"{hub.url}/hub/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpulab_warm_pool_claimed_total" and s.labels.get("profile") == slug:
                return s.value
    return None


def test_a_member_pod_holds_the_pools_reservation_and_a_start_takes_its_node_and_gpu(
    warm_hub, cluster
):
    hub = warm_hub
    member = running_member(cluster)
    # the member: on a node with the GPU limits a server of the profile gets, the pool's
    # preemptible reservation in its annotation, and nothing of a tenant
    held = placement_of(member)
    assert held["request"]["owner"] == WARM_POOL_OWNER
    assert held["request"]["id"].startswith(f"{WARM_POOL_OWNER}/a100-1-")
    assert held["request"]["priority"] == "preemptible"
    assert member["spec"]["nodeName"] == held["node"] == "gk-a100"
    main = member["spec"]["containers"][0]
    assert main["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert main["image"].rsplit("/", 1)[-1].startswith("pause")
    assert member["spec"]["initContainers"][0]["image"] == "gpulab/singleuser:dev"
    assert member["spec"]["priorityClassName"] == "gpulab-preemptible"
    assert member["spec"]["automountServiceAccountToken"] is False
    assert not member["spec"].get("volumes")  # no token volume, no home, no key
    assert all(not c.get("volumeMounts") and not c.get("env") for c in member["spec"]["containers"])
    assert member["metadata"]["labels"][WARM_MEMBER_LABEL] == "true"
    assert main["securityContext"]["runAsUser"] == 65535
    allocations = hub.allocations()
    assert allocations[held["request"]["id"]]["owner"] == WARM_POOL_OWNER
    assert hub.capacity()["a100-1"]["ready_now"] == 1
    assert hub.capacity()["a100-1"]["free"] == 7  # the member holds one of 8

    hub.create_user("kim")
    hub.start_server("kim", profile="a100-1")
    assert re.search(r"kim/ \(profile a100-1\) served warm by gpulab:warm-pool/a100-1-", hub.log())
    pod = placed_pod_of(cluster, "kim")
    hers = placement_of(pod)
    # her own pod, on the member's node and GPU
    assert pod["metadata"]["name"] != member["metadata"]["name"]
    assert pod["spec"]["nodeName"] == member["spec"]["nodeName"]
    assert hers["node"] == held["node"] and hers["gpus"] == held["gpus"]
    assert hers["request"]["owner"] == "kim" and hers["request"]["priority"] == "on-demand"
    assert pod["spec"]["priorityClassName"] == "gpulab-on-demand"
    # the member pod is gone; the share is hers, not the pool's (and counted once)
    names = [p["metadata"]["name"] for p in member_pods(cluster)]
    assert member["metadata"]["name"] not in names
    allocations = hub.allocations()
    assert held["request"]["id"] not in allocations
    assert [g["uuid"] for g in allocations["kim/"]["gpus"]] == [u for u, _ in held["gpus"]]
    assert claimed_total(hub, "a100-1") == 1.0

    # the pool refills with a new member pod on another GPU
    refill = running_member(cluster, other_than=member["metadata"]["name"])
    assert placement_of(refill)["gpus"] != held["gpus"]
    wait_for(
        "6 A100s free (hers and the new member's held)",
        lambda: hub.capacity()["a100-1"]["free"] == 6,
    )

    hub.stop_server("kim")
    wait_for("7 A100s free", lambda: hub.capacity()["a100-1"]["free"] == 7)


def test_another_profile_starts_cold_and_leaves_the_member(warm_hub, cluster):
    hub = warm_hub
    member = running_member(cluster)
    hub.create_user("tia")
    hub.start_server("tia", profile="t4-1")
    assert "served warm" not in hub.log()
    assert placed_pod_of(cluster, "tia")["spec"]["nodeName"] == "gk-t4"
    assert [p["metadata"]["name"] for p in member_pods(cluster)] == [member["metadata"]["name"]]
    assert claimed_total(hub, "a100-1") == 0.0
    hub.stop_server("tia")


def test_an_on_demand_start_that_does_not_fit_takes_the_members_gpu(warm_hub, cluster):
    hub = warm_hub
    member = running_member(cluster)
    for user in ("ann", "bob"):
        hub.create_user(user)
    hub.start_server("ann", profile="a100-4")  # 7 free -> 3
    hub.start_server("bob", profile="a100-4")  # needs 4: only the member's GPU makes room
    assert placed_pod_of(cluster, "bob")["spec"]["nodeName"] == "gk-a100"
    wait_for(
        "the member pod to go",
        lambda: (
            member["metadata"]["name"] not in [p["metadata"]["name"] for p in member_pods(cluster)]
        ),
    )
    assert not [a for a in hub.allocations().values() if a["owner"] == WARM_POOL_OWNER]
    assert hub.capacity()["a100-1"]["free"] == 0
    hub.stop_server("bob")
    # room again: the pool makes a member
    running_member(cluster, other_than=member["metadata"]["name"])
    hub.stop_server("ann")


def test_a_restarted_hub_deletes_the_member_pods_the_previous_one_left(make_hub, cluster):
    first = _hub(make_hub, cluster)
    orphan = running_member(cluster)
    os.killpg(first.proc.pid, signal.SIGKILL)  # no shutdown at all: its member pod stays
    first.proc.wait(10)
    assert orphan["metadata"]["name"] in [p["metadata"]["name"] for p in member_pods(cluster)]

    second = _hub(make_hub, cluster)
    fresh = running_member(cluster, other_than=orphan["metadata"]["name"])
    wait_for(
        "the orphan member pod to be deleted",
        lambda: (
            orphan["metadata"]["name"] not in [p["metadata"]["name"] for p in member_pods(cluster)]
        ),
    )
    pool_allocations = [a for a in second.allocations() if a.startswith(WARM_POOL_OWNER)]
    assert pool_allocations == [placement_of(fresh)["request"]["id"]]
    assert second.capacity()["a100-1"]["free"] == 7
