"""The cross-user attack catalogue (tests/harness/isolation.py) against a real hub with GPUKubeSpawner on
the real dev cluster: every attempt from the attacker's pod, her server token and her API token
must be refused, none may leak or fail with a 5xx."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import urllib.error
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from gpulab.spawner.kube.pod_security import pod_security_labels
from gpulab.spawner.names import DASK_CLUSTER_LABEL, WARM_MEMBER_LABEL
from tests.harness.dask_kube import running_dask_operator
from tests.harness.hub import merged, run_in_kernel
from tests.harness.isolation import VICTIM, prepare_victim, table
from tests.harness.isolation_dask import start_victim_cluster, stop_victim_cluster
from tests.harness.isolation_kube import kube_attack_suite, kube_kernel_attacks, metadata_endpoint
from tests.harness.jobs import until, user_client
from tests.harness.kube import (
    KUBE_WORKSPACE_OVERLAY,
    SPAWNER_NODES,
    Kube,
    fresh_namespace,
    kube_hub_overlay,
)
from tests.harness.pod_security import restricted_violations
from tests.harness.wait import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the dev cluster and the metadata address on lo need root"
)

POLICIES = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"


@pytest.fixture(scope="module")
def cluster(make_dev_cluster) -> DevCluster:
    return make_dev_cluster(SPAWNER_NODES, "gk-iso-cluster")


@pytest.fixture(scope="module")
def dask_operator(cluster, tmp_path_factory) -> Iterator[None]:
    """The dask-kubernetes operator: it makes the victim's Dask cluster's pods (the catalogue's
    Dask attempts)."""
    with running_dask_operator(cluster, tmp_path_factory.mktemp("dask") / "operator.log"):
        yield


async def test_no_attack_of_the_catalogue_succeeds_on_the_kube_backend(
    make_hub, cluster, dask_operator
):
    hub = make_hub(
        kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY),
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )
    with metadata_endpoint():
        attempts = await kube_attack_suite(hub, cluster)
    assert len(attempts) >= 50  # the catalogue ran whole
    failed = [a for a in attempts if a.outcome != "refused"]
    assert not failed, table(attempts)
    assert {a.category for a in attempts} >= {
        "kube:network",
        "kube:files",
        "kube:processes",
        "kube:dask",
    }
    # and the victim is as she was: her server still runs
    assert hub.server_model(VICTIM)["ready"]


async def test_the_catalogue_finds_the_leaks_of_pods_without_network_policy_or_with_a_token(
    make_hub, cluster
):
    # the same probes where the servers' NetworkPolicy is gone and pods get the namespace's
    # service-account token: they must report those leaks, or the test above would prove nothing
    # about the network and the token
    with contextlib.suppress(urllib.error.HTTPError):  # left by the test above, if it ran
        cluster.api("DELETE", f"{POLICIES}/gpulab-singleuser")
    unguarded = {"network_policy": False, "automount_service_account_token": True}
    hub = make_hub(
        merged(
            kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY),
            Config({"GPUKubeSpawner": unguarded}),
        ),
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )
    assert not cluster.api("GET", POLICIES)["items"]
    with metadata_endpoint():
        await prepare_victim(hub, profile="cpu")
        attempts = await kube_kernel_attacks(hub, cluster)
    leaked = {a.name for a in attempts if a.outcome == "leak"}
    assert {
        "victim's server",
        "cloud metadata 169.254.169.254:80",
        "a host service on every address, at the host address",
        "kube-proxy's health port, on the nodes' network",
        # TCP connections only: the kubelet API's client certificate check stays (its own
        # test), and the API server asks who is calling (as in every cluster, pods reach it
        # through the `kubernetes` Service; only the NetworkPolicy keeps servers off it)
        "her node's kubelet API",
        "Kubernetes API server",
        "service-account token",
    } <= leaked, table(attempts)
    # etcd, the agent and the hub's other ports listen on the host's 127.0.0.1, which is no
    # pod's (each has a network namespace of its own): out of reach even here
    refused = {a.name for a in attempts if a.outcome == "refused"}
    assert {
        "etcd (every Secret, unauthenticated)",
        "node agent control API",
    } <= refused, table(attempts)


# -- Pod Security admission: `restricted` on the user namespace -------------------------------

#: an init container as an admin adds one (GPUKubeSpawner.init_containers): no securityContext
ADMIN_INIT = {
    "name": "admin-init",
    "image": "busybox",  # not pulled: the node agent runs the command
    "command": [sys.executable, "-c", "print('admin init ran')"],
}
#: long enough to be seen Running (the hub deletes a Job once it has read its outcome)
JOB_SCRIPT = "import os, time; time.sleep(5); print('job ran as', os.getuid())\n"


@pytest.fixture
def restricted(cluster: DevCluster) -> Iterator[Kube]:
    """A namespace that enforces Pod Security `restricted` (latest), as the chart labels its own."""
    with fresh_namespace(cluster, pod_security_labels("restricted"), prefix="restricted") as k:
        yield k


def pods_in(kube: Kube, selector: str) -> list[dict[str, Any]]:
    query = urllib.parse.quote(selector)
    return list(
        kube.api("GET", f"/api/v1/namespaces/{kube.ns}/pods?labelSelector={query}")["items"]
    )


def pods_of_phase(kube: Kube, selector: str, phase: str, count: int = 1) -> list[dict[str, Any]]:
    def check() -> list[dict[str, Any]] | None:
        pods = [p for p in pods_in(kube, selector) if p["status"].get("phase") == phase]
        return pods if len(pods) >= count else None

    return wait_for(f"{count} {phase} pod(s) {selector} in {kube.ns}", check, 120)


def refused_as(kube: Kube, namespace: str, pod: dict[str, Any]) -> str:
    """The API server's answer to a dry-run create of `pod` in `namespace` ("" when admitted)."""
    try:
        kube.api("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod)
    except urllib.error.HTTPError as e:
        return f"{e.code} {json.loads(e.read())['message']}"
    return ""


async def test_every_pod_gpulab_makes_is_admitted_and_runs_under_restricted_pod_security(
    make_hub, cluster, dask_operator, restricted
):
    ns = restricted.ns
    hub = make_hub(
        merged(
            kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY),
            Config(
                {
                    "GPUKubeSpawner": {"namespace": ns, "init_containers": [ADMIN_INIT]},
                    "GPUWarmPool": {
                        "pools": [{"profile": "a100-1", "min": 1, "max": 1}],
                        "check_interval_seconds": 1,
                    },
                    "GPUJobs": {"admission_interval_seconds": 0.5},
                }
            ),
        ),
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )
    # a warm pool member (its image-pulling init container and the pause container)
    (member,) = pods_of_phase(restricted, f"{WARM_MEMBER_LABEL}=true", "Running")

    # a server, with the admin's init container (hardened by the spawner), Running and Ready
    hub.create_user("pia")
    hub.start_server("pia", profile="cpu")
    (server,) = pods_of_phase(restricted, "hub.jupyter.org/username=pia", "Running")
    (init,) = server["status"]["initContainerStatuses"]
    assert init["state"]["terminated"]["exitCode"] == 0
    write = f"open(os.path.join(os.environ['HOME'], 'psa_job.py'), 'w').write({JOB_SCRIPT!r})"
    await run_in_kernel(hub, "pia", f"import os; {write}")

    # the label enforces (so nothing above passed vacuously): her pod without runAsNonRoot is
    # refused here, and admitted where the namespace is not restricted
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "no-run-as-non-root"}}
    bare["spec"] = copy.deepcopy(server["spec"])
    bare["spec"].pop("nodeName")
    bare["spec"]["securityContext"].pop("runAsNonRoot")
    for container in [*bare["spec"]["containers"], *bare["spec"]["initContainers"]]:
        container["securityContext"].pop("runAsNonRoot")
    refusal = refused_as(restricted, ns, bare)
    assert refusal.startswith("403 ") and 'violates PodSecurity "restricted:latest"' in refusal
    assert "runAsNonRoot" in refusal
    assert refused_as(restricted, "default", bare) == ""
    assert restricted_violations(bare["spec"]) != []  # the unit tests' check agrees
    hub.stop_server("pia")

    # a job (the script she wrote in her home): its pod Running, the run succeeded (exit 0)
    pia = user_client(hub, "pia")
    body = {"name": "psa", "kind": "script", "path": "psa_job.py", "profile": "cpu"}
    r = pia.post("/users/pia/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    (job_pod,) = pods_of_phase(restricted, f"gpulab.io/job-run={run_id}", "Running")
    until(pia, f"/users/pia/jobs/{run_id}", "succeeded", timeout=120)

    # a Dask cluster: its scheduler and worker (the dask-kubernetes operator's pods), Running
    dask_cluster = start_victim_cluster(hub, "pia")
    try:
        dask_pods = pods_of_phase(
            restricted, f"{DASK_CLUSTER_LABEL}={dask_cluster['id']}", "Running", count=2
        )
        roles = sorted(p["metadata"]["labels"].get("dask.org/component") for p in dask_pods)
        assert roles == ["scheduler", "worker"]
    finally:
        stop_victim_cluster(hub, "pia", dask_cluster)

    # what ran is what the unit tests check, and no controller was refused a pod meanwhile
    for pod in [member, server, job_pod, *dask_pods]:
        assert restricted_violations(pod["spec"]) == [], pod["metadata"]["name"]
    events = restricted.api("GET", f"/api/v1/namespaces/{ns}/events")["items"]
    refused = [e["message"] for e in events if "violates PodSecurity" in e.get("message", "")]
    assert refused == []
