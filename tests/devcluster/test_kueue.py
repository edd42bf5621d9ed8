"""Kueue and JobSet, built from their Go modules, as out-of-cluster controllers beside a dev
cluster of this module's own (`gpulab.devcluster.batch`): a ClusterQueue's quota decides which
JobSet runs, and the node agent runs the admitted JobSet's pods to completion.

A cluster of its own: Kueue's and JobSet's webhooks are registered while they run, and no other
module's pods should meet them."""

from __future__ import annotations

import json
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.devcluster import DevCluster, NodeSpec
from gpulab.devcluster.batch import QUEUE_LABEL, running_jobset, running_kueue
from tests.harness.wait import wait_for

#: run after the other dev-cluster tests (tests/harness/fixtures.py: their builds overlap those)
pytestmark = pytest.mark.batch_controllers

NODE = NodeSpec("kq-gpu-0", gpus=8, cpu=16, memory_gib=64)
NS = "kueue-test"
QUEUE = "team-a"
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
#: the ClusterQueue's GPUs: the first JobSet takes 3, the second wants 2
GPU_QUOTA = 4
#: a pod of the first JobSet waits for this file (its hostPath folder mounted at /gate), so the
#: test decides when it ends; bounded, so a failed test leaves no pod waiting for ever
GATED = (
    "import os, sys, time\n"
    "deadline = time.time() + 240\n"
    "while not os.path.exists('/gate/release'):\n"
    "    if time.time() > deadline:\n"
    "        sys.exit(3)\n"
    "    time.sleep(0.2)\n"
)


@pytest.fixture(scope="module")
def cluster(make_dev_cluster: Callable[..., DevCluster]) -> Iterator[DevCluster]:
    c = make_dev_cluster([NODE], name="kueue-cluster")
    with running_jobset(c), running_kueue(c):
        yield c


def pod_template(command: list[str], gpus: int, gate: Path | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "python:3.11",  # not pulled: the node agent runs the command
        "command": command,
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"nvidia.com/gpu": str(gpus)},
        },
    }
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if gate is not None:
        spec["volumes"] = [
            {"name": "gate", "hostPath": {"path": str(gate), "type": "DirectoryOrCreate"}}
        ]
        container["volumeMounts"] = [{"name": "gate", "mountPath": "/gate"}]
    return {"spec": spec}


def replicated_job(name: str, pods: int, template: dict[str, Any]) -> dict[str, Any]:
    job = {"parallelism": pods, "completions": pods, "backoffLimit": 0, "template": template}
    return {"name": name, "replicas": 1, "template": {"spec": job}}


def jobset(name: str, *replicated: dict[str, Any]) -> dict[str, Any]:
    """A JobSet for the queue, not suspended: Kueue's webhook suspends it at admission."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NS, "labels": {QUEUE_LABEL: QUEUE}},
        "spec": {"replicatedJobs": list(replicated)},
    }


def queue_objects() -> list[tuple[str, dict[str, Any]]]:
    """ResourceFlavor, ClusterQueue (cpu, memory and GPUs matching what the node offers, GPUs
    fewer) and the namespace's LocalQueue."""
    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor"}
    quota = [
        {"name": "cpu", "nominalQuota": "8"},
        {"name": "memory", "nominalQuota": "32Gi"},
        {"name": "nvidia.com/gpu", "nominalQuota": str(GPU_QUOTA)},
    ]
    cq_spec = {
        "namespaceSelector": {},
        "resourceGroups": [
            {
                "coveredResources": [q["name"] for q in quota],
                "flavors": [{"name": "default-flavor", "resources": quota}],
            }
        ],
    }
    lq_spec = {"clusterQueue": "cluster-a"}
    return [
        (f"{KUEUE}/resourceflavors", {**flavor, "metadata": {"name": "default-flavor"}}),
        (
            f"{KUEUE}/clusterqueues",
            {**flavor, "kind": "ClusterQueue", "metadata": {"name": "cluster-a"}, "spec": cq_spec},
        ),
        (
            f"{KUEUE}/namespaces/{NS}/localqueues",
            {**flavor, "kind": "LocalQueue", "metadata": {"name": QUEUE}, "spec": lq_spec},
        ),
    ]


def workload_of(cluster: DevCluster, js: dict[str, Any]) -> dict[str, Any] | None:
    uid = js["metadata"]["uid"]
    for w in cluster.api("GET", f"{KUEUE}/namespaces/{NS}/workloads")["items"]:
        if any(o.get("uid") == uid for o in w["metadata"].get("ownerReferences", [])):
            return dict(w)
    return None


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return {}


def holds(obj: dict[str, Any] | None, kind: str) -> bool:
    return condition(obj, kind).get("status") == "True"


def admitted(cluster: DevCluster, js: dict[str, Any]) -> dict[str, Any] | None:
    """The JobSet's Workload once Admitted."""
    w = workload_of(cluster, js)
    return w if holds(w, "Admitted") else None


def left_pending(cluster: DevCluster, js: dict[str, Any]) -> dict[str, Any] | None:
    """The JobSet's Workload once Kueue has tried and failed to reserve its quota."""
    w = workload_of(cluster, js)
    return w if condition(w, "QuotaReserved").get("reason") == "Pending" else None


def get_jobset(cluster: DevCluster, name: str) -> dict[str, Any]:
    return dict(cluster.api("GET", f"{JOBSETS}/{name}"))


def completed(cluster: DevCluster, name: str) -> bool:
    return holds(get_jobset(cluster, name), "Completed")


def phases(cluster: DevCluster, name: str) -> list[str]:
    """The phases of the JobSet's pods."""
    selector = urllib.parse.quote(f"jobset.sigs.k8s.io/jobset-name={name}")
    path = f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}"
    return [p["status"].get("phase", "") for p in cluster.api("GET", path)["items"]]


def running_unsuspended(cluster: DevCluster, name: str, pods: int) -> bool:
    suspended = get_jobset(cluster, name)["spec"].get("suspend")
    return suspended is False and phases(cluster, name) == ["Running"] * pods


def test_the_cluster_queue_admits_a_jobset_within_quota_and_holds_the_next_until_it_ends(
    cluster: DevCluster, tmp_path: Path
) -> None:
    cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
    for collection, obj in queue_objects():
        cluster.api("POST", collection, obj)
    cq = f"{KUEUE}/clusterqueues/cluster-a"
    wait_for("the ClusterQueue to be Active", lambda: holds(cluster.api("GET", cq), "Active"), 60)
    gated = pod_template([sys.executable, "-c", GATED], gpus=1, gate=tmp_path)
    quick = pod_template([sys.executable, "-c", "pass"], gpus=1)
    first = jobset("first", replicated_job("leader", 1, gated), replicated_job("workers", 2, gated))
    second = jobset("second", replicated_job("workers", 2, quick))

    made = cluster.api("POST", JOBSETS, first)
    assert made["spec"]["suspend"] is True, "Kueue's webhook suspends a queued JobSet"
    workload = wait_for(
        "the first JobSet's Workload to be Admitted", lambda: admitted(cluster, made), 120
    )
    assert workload["status"]["admission"]["clusterQueue"] == "cluster-a"
    wait_for(
        "the first JobSet to be unsuspended with its 3 pods Running",
        lambda: running_unsuspended(cluster, "first", 3),
        120,
    )

    held = cluster.api("POST", JOBSETS, second)
    pending = wait_for(
        "the second JobSet's Workload to be left pending", lambda: left_pending(cluster, held), 60
    )
    assert not holds(pending, "Admitted")
    assert "insufficient" in condition(pending, "QuotaReserved")["message"].lower(), pending
    assert get_jobset(cluster, "second")["spec"]["suspend"] is True
    assert phases(cluster, "second") == []
    # the first is still running meanwhile: its pods wait for the gate
    assert running_unsuspended(cluster, "first", 3)

    (tmp_path / "release").touch()
    wait_for("the first JobSet to be Completed", lambda: completed(cluster, "first"), 120)
    assert set(phases(cluster, "first")) == {"Succeeded"}
    wait_for(
        "the second JobSet's Workload to be Admitted once the first's quota is free",
        lambda: admitted(cluster, held),
        120,
    )
    wait_for("the second JobSet to be Completed", lambda: completed(cluster, "second"), 120)
    finished = workload_of(cluster, held)
    assert holds(finished, "Finished"), json.dumps(finished)[:2000]
