"""The chart on a real API server (the dev cluster's Kubernetes 1.37, a cluster of this module's
own: the chart's PriorityClasses and ClusterRoles are cluster-wide, and Helm refuses to adopt
objects another test made): the rendered manifests pass a server-side dry run, and a release is
installed through the Helm engine, serves a GPU server, is upgraded to a later chart version
with other values, and is uninstalled (helm/tools/install.py does each step)."""

from __future__ import annotations

import copy
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpulab.devcluster import DevCluster, NodeSpec
from gpulab.spawner.kube.dask_operator import CRD_NAMES
from gpulab.spawner.kube.pod_security import pod_security_labels
from tests.helm.conftest import find, load_tool

# gpu-1's server and the placeholder that holds a GPU for the next one
NODES = [NodeSpec("gpu-0", gpus=8)]


#: the dask-kubernetes operator's CRDs (created by the chart's hook Job once Dask is on)
DASK_CRDS = [f"{name}s.kubernetes.dask.org" for name in CRD_NAMES]


@pytest.fixture(scope="module")
def install_tool() -> ModuleType:
    return load_tool("install")


@pytest.fixture(scope="module")
def cluster(make_dev_cluster: Callable[..., DevCluster]) -> DevCluster:
    return make_dev_cluster(NODES, "chart-cluster")


@pytest.fixture
def namespace(cluster: DevCluster) -> Iterator[str]:
    name = f"chart-{uuid.uuid4().hex[:6]}"
    cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    yield name
    cluster.api("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def restricted_namespace(cluster: DevCluster, install_tool: ModuleType) -> Iterator[str]:
    """A namespace labelled as the chart's hook labels its own (singleuser.podSecurity)."""
    name = f"chart-restricted-{uuid.uuid4().hex[:6]}"
    labels = pod_security_labels("restricted")
    cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
    install_tool.wait_for(
        f"namespace {name}'s default ServiceAccount",
        lambda: cluster.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts")["items"],
        60,
    )
    yield name
    cluster.api("DELETE", f"/api/v1/namespaces/{name}")


@pytest.mark.parametrize("values", ["default", "lint-values"])
def test_pod_security_restricted_admits_the_pod_of_every_rendered_workload(
    cluster: DevCluster,
    restricted_namespace: str,
    install_tool: ModuleType,
    default_objects: list[dict[str, Any]],
    all_options_objects: list[dict[str, Any]],
    values: str,
) -> None:
    """Pod Security admission judges pods, not Deployments or Jobs (those only get a warning):
    each workload's pod template as the Pod its controller would make, in a dry run (without
    its account and priority class, which this namespace and cluster do not have: the other
    admission plugins would refuse the pod for them first)."""
    objects = default_objects if values == "default" else all_options_objects
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{o['kind'].lower()}-{o['metadata']['name']}"},
            "spec": {
                k: v
                for k, v in o["spec"]["template"]["spec"].items()
                if k not in ("serviceAccountName", "priorityClassName")
            },
        }
        for o in objects
        if o["kind"] in ("Deployment", "Job")
    ]
    assert len(pods) >= 3
    assert install_tool.server_dry_run(cluster, pods, restricted_namespace) == []
    # and the label enforces: the hub's pod without runAsNonRoot is refused there
    (hub,) = [copy.deepcopy(p) for p in pods if p["metadata"]["name"].endswith("-hub")]
    hub["spec"]["securityContext"].pop("runAsNonRoot")
    for container in hub["spec"]["containers"]:
        container["securityContext"].pop("runAsNonRoot")
    (error,) = install_tool.server_dry_run(cluster, [hub], restricted_namespace)
    assert error.startswith(f"Pod/{hub['metadata']['name']}: 403"), error
    assert 'violates PodSecurity "restricted:latest"' in error and "runAsNonRoot" in error


@pytest.mark.parametrize("values", ["default", "lint-values"])
def test_the_api_server_accepts_every_rendered_object_in_a_server_side_dry_run(
    cluster: DevCluster,
    namespace: str,
    install_tool: ModuleType,
    default_objects: list[dict[str, Any]],
    all_options_objects: list[dict[str, Any]],
    values: str,
) -> None:
    objects = default_objects if values == "default" else all_options_objects
    assert install_tool.server_dry_run(cluster, objects, namespace) == []


def test_the_dry_run_reports_what_the_api_server_refuses(
    cluster: DevCluster, namespace: str, install_tool: ModuleType, default_objects: list[Any]
) -> None:
    """The dry run is the API server's judgement: a Service without ports is refused by its
    validation (which the chart's schema checks do not run)."""
    (service,) = find(default_objects, "Service", "gpulab-hub")
    broken = {**service, "spec": {**service["spec"], "ports": []}}
    (error,) = install_tool.server_dry_run(cluster, [broken], namespace)
    assert error.startswith("Service/gpulab-hub: 422") and "spec.ports" in error


def test_install_spawn_upgrade_and_uninstall(
    cluster: DevCluster, install_tool: ModuleType, tmp_path: Path
) -> None:
    tool = install_tool
    ns = tool.NAMESPACE
    token = secrets.token_hex(16)
    version = tool.chart_version()
    with tool.helm(cluster) as helm:
        # install: the hub answers its REST API through the proxy's public Service
        started = time.monotonic()
        release = tool.install(helm, tool.CHART, tool.check_values(token))
        assert release["status"] == "deployed" and release["chart_version"] == version
        hub = tool.Hub(cluster, token)
        hub.wait()
        print(f"install_ready_s={time.monotonic() - started:.1f}")
        # the pre-install hook labelled the namespace (singleuser.podSecurity: restricted), so
        # every pod below, the user's server among them, was admitted under it; its account and
        # rights went with it
        labels = cluster.api("GET", f"/api/v1/namespaces/{ns}")["metadata"]["labels"]
        assert pod_security_labels("restricted").items() <= labels.items()
        assert tool.pods(cluster, "component=pod-security") == []

        # the placeholder (a pause image, no command) runs and holds the profile's GPU
        (placeholder,) = tool.wait_for(
            "the gpu-1 placeholder to be ready",
            lambda: [p for p in tool.pods(cluster, "component=gpu-placeholder") if tool.ready(p)],
            60,
        )
        limits = placeholder["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"

        # a GPU server through the installed hub: ready, answering through the proxy, its pod
        # holding a GPU and prefixed with the home preparation (singleuser.cmd)
        started = time.monotonic()
        server = hub.spawn(tool.USER, tool.GPU_PROFILE)
        print(f"spawn_s={time.monotonic() - started:.1f}")
        assert server["ready"] and server["user_options"]["profile"] == tool.GPU_PROFILE
        (pod,) = tool.pods(cluster, "component=singleuser-server")
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        args = container["args"]
        assert "gpulab.spawner.singleuser.checkpoint.prepare" in args[: args.index("--")]
        assert args[args.index("--") + 1] == "jupyterhub-singleuser"

        # upgrade to a later chart version with other values: the secrets kept by `lookup`
        # survive, the hub restarts (its config changed) and finds the user and her server
        secret = tool.hub_secret(cluster)
        (old_hub,) = tool.pods(cluster, "component=hub")
        later = tool.next_patch(version)
        upgraded = tool.upgrade(
            helm,
            tool.chart_copy(later, tmp_path),
            # and Dask on: the pre-upgrade hook Job creates the operator's CRDs, then the
            # operator runs (both from the hub's image, through gpulab's entry point)
            tool.check_values(token, gpulab={"cullIdleSeconds": 7200, "dask": {"enabled": True}}),
        )
        assert upgraded["revision"] == 2 and upgraded["chart_version"] == later
        for crd in DASK_CRDS:
            found = cluster.api(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"
            )
            conditions = {c["type"]: c["status"] for c in found["status"]["conditions"]}
            assert conditions["Established"] == "True", crd
        # the hook's account and rights went with it once it succeeded
        assert tool.pods(cluster, "component=dask-crds") == []
        tool.wait_for(
            "the Dask operator to be ready",
            lambda: [p for p in tool.pods(cluster, "component=dask-operator") if tool.ready(p)],
            tool.HUB_TIMEOUT,
        )
        new_hub = tool.wait_for(
            "a new hub pod to be ready",
            lambda: [
                p
                for p in tool.pods(cluster, "component=hub")
                if p["metadata"]["uid"] != old_hub["metadata"]["uid"] and tool.ready(p)
            ],
            tool.HUB_TIMEOUT,
        )
        assert new_hub[0]["metadata"]["labels"]["chart"] == f"gpulab-{later}"
        hub.wait()
        assert tool.hub_secret(cluster) == secret
        after = hub.server(tool.USER)
        assert after is not None and after["ready"] and after["started"] == server["started"]
        hub.request("GET", f"/user/{tool.USER}/api/status")

        # uninstall: the user's server stopped first (the spawner's objects are not the
        # release's), then nothing of the release is left but the hub's claim, which the
        # chart keeps (helm.sh/resource-policy: keep) with the hub's database
        hub.stop(tool.USER)
        manifest = tool.manifests_of(upgraded)
        helm.uninstall(tool.RELEASE, wait="watcher", timeout=120)
        left = tool.wait_for(
            "the release's objects to be deleted",
            lambda: (
                (rest := tool.leftovers(cluster, manifest, ns))
                == ["PersistentVolumeClaim/gpulab-hub"]
                and rest
            ),
            60,
        )
        assert left == ["PersistentVolumeClaim/gpulab-hub"]
        # the Dask CRDs stay (deleting them would delete every user's Dask cluster)
        crds = cluster.api("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        assert set(DASK_CRDS) <= {c["metadata"]["name"] for c in crds["items"]}
        assert tool.release_records(cluster) == []
        # the Deployments' pods go after them (the garbage collector, then their grace period)
        tool.wait_for(
            "the release's pods to be gone",
            lambda: tool.pods(cluster, "release=gpulab") == [],
            60,
        )
    cluster.api("DELETE", f"/api/v1/namespaces/{ns}")
