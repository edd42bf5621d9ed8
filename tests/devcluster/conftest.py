"""A real Kubernetes control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)
plus gpulab's node agent, once per test session.

The first session on a machine builds the Kubernetes binaries (~10 min on 2 cores) into
~/.cache/gpulab (or $GPULAB_KUBE_CACHE); later sessions start the cluster in ~10 s.
"""

from __future__ import annotations

import json
import time
import urllib.error
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulab.devcluster import DevCluster, NodeSpec
from tests.harness.cluster import running_dev_cluster

# gpu-a: the scheduler test's 8 GPUs; gpu-b: MIG, time-slicing and HAMi resources;
# gpu-fail: the node the failure test stops; gpu-spot: a tainted spot node
KUBE_NODES = [
    NodeSpec("gpu-a", gpus=8, zone="zone-a", rack="rack-1"),
    NodeSpec(
        "gpu-b",
        gpus=2,
        gpu_product="NVIDIA-H100-80GB-HBM3",
        zone="zone-b",
        rack="rack-2",
        mig={"1g.10gb": 7, "3g.40gb": 2},
        time_slicing_replicas=4,
    ),
    NodeSpec("gpu-fail", gpus=1, zone="zone-c", rack="rack-3"),
    NodeSpec("gpu-spot", gpus=4, zone="zone-b", rack="rack-4", spot=True),
]
BUILD_TIMEOUT_NOTE = "a cold build takes ~10 min on 2 cores; later sessions use the cache"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kube: runs against the real dev-cluster control plane (builds Kubernetes once per machine)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.kube)


@pytest.fixture(scope="session")
def dev_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """The session's cluster: KUBE_NODES, fast node-failure timing, stopped at the end."""
    with running_dev_cluster(tmp_path_factory.mktemp("dev-cluster"), KUBE_NODES) as cluster:
        yield cluster


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = 60, interval: float = 0.2
) -> Any:
    """Poll check() until it returns something truthy; fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def pod_manifest(
    name: str,
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    gpus: int = 0,
    node: str | None = None,
    restart: str = "Never",
    **container: Any,
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": "main",
        "image": "python:3.11",
        "command": command,
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
        **container,
    }
    if gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {"restartPolicy": restart, "containers": [c]}
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


class Kube:
    """Blocking helpers over the cluster's REST API; deletes what the test created."""

    def __init__(self, cluster: DevCluster, ns: str = "default") -> None:
        self.cluster = cluster
        self.ns = ns
        self.pods: list[str] = []
        self.pvcs: list[str] = []

    def name(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:6]}"

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self.cluster.api(method, path, body)

    def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.pods.append(manifest["metadata"]["name"])
        return self.api("POST", f"/api/v1/namespaces/{self.ns}/pods", manifest)

    def pod(self, name: str) -> dict[str, Any] | None:
        try:
            return self.api("GET", f"/api/v1/namespaces/{self.ns}/pods/{name}")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def phase(self, name: str) -> str | None:
        p = self.pod(name)
        return p and p.get("status", {}).get("phase")

    def wait_phase(self, name: str, *phases: str, timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            p = self.pod(name)
            return p if p and p.get("status", {}).get("phase") in phases else None

        return wait_for(f"pod {name} to be {'/'.join(phases)}", check, timeout)

    def wait_ready(self, name: str, timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            p = self.pod(name)
            conds = (p or {}).get("status", {}).get("conditions", [])
            return p if any(c["type"] == "Ready" and c["status"] == "True" for c in conds) else None

        return wait_for(f"pod {name} to be Ready", check, timeout)

    def delete_pod(self, name: str, grace: int | None = None) -> None:
        body = {} if grace is None else {"gracePeriodSeconds": grace}
        try:
            self.api("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", body)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise

    def wait_gone(self, name: str, timeout: float = 60) -> None:
        wait_for(f"pod {name} to be deleted", lambda: self.pod(name) is None, timeout)

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.api("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [e for e in items if e["involvedObject"].get("name") == name]

    def node(self, name: str) -> dict[str, Any]:
        return self.api("GET", f"/api/v1/nodes/{name}")

    def node_ready(self, name: str) -> str:
        conds = self.node(name).get("status", {}).get("conditions", [])
        return next((c["status"] for c in conds if c["type"] == "Ready"), "missing")

    def close(self) -> None:
        for name in self.pods:
            self.delete_pod(name, grace=0)
        for name in self.pvcs:
            try:
                self.api("DELETE", f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{name}")
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    raise
        for name in self.pods:
            wait_for(f"pod {name} to go away", lambda n=name: self.pod(n) is None, 60)


@pytest.fixture
def kube(dev_cluster: DevCluster) -> Iterator[Kube]:
    k = Kube(dev_cluster)
    yield k
    k.close()


@pytest.fixture
def kube_ns(dev_cluster: DevCluster) -> Iterator[Kube]:
    """Like `kube`, in a fresh namespace (ready for pods: its ServiceAccount token exists);
    the namespace is deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    dev_cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})

    def service_account_ready() -> bool:
        try:
            sa = dev_cluster.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
        except urllib.error.HTTPError:
            return False
        return bool(sa.get("secrets"))

    wait_for(f"namespace {name}'s default ServiceAccount", service_account_ready, 60)
    k = Kube(dev_cluster, name)
    yield k
    k.close()
    dev_cluster.api("DELETE", f"/api/v1/namespaces/{name}")


def container_state(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["status"]["containerStatuses"][0]["state"]


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:3000]
