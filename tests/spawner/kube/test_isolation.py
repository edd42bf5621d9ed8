"""The cross-user attack catalogue (tests/harness/isolation.py) against a real hub with GPUKubeSpawner on
the real dev cluster: every attempt from the attacker's pod, her server token and her API token
must be refused, none may leak or fail with a 5xx."""

from __future__ import annotations

import contextlib
import os
import urllib.error
from collections.abc import Iterator

import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster
from tests.harness.dask_kube import running_dask_operator
from tests.harness.hub import merged
from tests.harness.isolation import VICTIM, prepare_victim, table
from tests.harness.isolation_kube import kube_attack_suite, kube_kernel_attacks, metadata_endpoint
from tests.harness.kube import KUBE_WORKSPACE_OVERLAY, SPAWNER_NODES, kube_hub_overlay

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
