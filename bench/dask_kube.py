"""bench.dask's Kubernetes backend: the stock dask-kubernetes KubeCluster and gpulab's clusters,
both on a private dev cluster with the dask-kubernetes operator as gpulab runs it.

Apart from the run (`bench.dask`) because this phase needs the `kube` extra and a dev cluster,
which `kube_unavailable` checks before anything of it is imported; its sides are timed by the
same measurement (`bench.dask_measure`) as the local ones.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from importlib.metadata import version
from pathlib import Path
from typing import Any

from traitlets.config import Config

from bench.dask_measure import Backend, measure
from bench.dask_sides import (
    USER,
    GpulabClusters,
    GpulabLocal,
    Leftovers,
    Running,
    scheduler_workers,
)

#: the label the dask-kubernetes operator puts on every pod of a cluster
CLUSTER_LABEL = "dask.org/cluster-name"
#: the stock KubeClusters' names (gpulab's clusters are named by gpulab's backend)
STOCK_PREFIX = "bench-stock-"
#: Kubernetes: two A100s time-sliced four ways (eight quarter shares: N workers of either side)
KUBE_SHARE_RESOURCE = "nvidia.com/gpu.shared"
KUBE_PROFILE = "a100-quarter"  # one of tests.harness.kube's profiles
KUBE_OVERLAY = Config(
    GPUKubeSpawner={"gpu_sharing": "time-slicing"}, GPUCapacity={"default_user_quota_gpus": 8}
)


def kube_node() -> Any:
    from gpulab.devcluster import NodeSpec

    return NodeSpec(
        "bench-a100",
        gpus=2,
        sharing="time-slicing",
        replicas=4,
        cpu=64,
        memory_gib=256,
        zone="zone-a",
        rack="rack-1",
    )


def kube_unavailable() -> str | None:
    """Why the Kubernetes phase cannot run in this checkout, or None when it can."""
    try:
        from gpulab.hub.daskservice.executor import RunsDaskClusters
        from gpulab.spawner.kube.spawner import GPUKubeSpawner
    except ImportError as e:
        return f"gpulab[kube] is not installed ({e})"
    if not isinstance(GPUKubeSpawner, RunsDaskClusters):
        return "the Kubernetes backend runs no Dask clusters yet (GPUKubeSpawner.dask_executor)"
    try:
        from gpulab.devcluster import DevCluster  # noqa: F401
        from gpulab.spawner.kube import dask_operator  # noqa: F401
    except ImportError as e:
        return f"cannot run the dev cluster's operator here ({e.name} missing)"
    return None


def stock_cluster_spec(name: str, n: int) -> dict[str, Any]:
    """dask-kubernetes' own spec (``make_cluster_spec``) with the commands as this machine runs
    them (the node agent runs a container's command as a process: this Python, not an image's
    entrypoint) and each worker on one time-sliced GPU share, as gpulab's quarter profile."""
    from dask_kubernetes.operator import make_cluster_spec

    spec: dict[str, Any] = make_cluster_spec(
        name,
        n_workers=n,
        worker_command=[sys.executable, "-m", "distributed.cli.dask_worker"],
        # outside the cluster: the scheduler at a node's address, as kube-proxy forwards it.
        # Here, not as KubeCluster's own argument, which a custom spec overrides: a ClusterIP
        # Service's name does not resolve on this host, and KubeCluster then port-forwards
        # through the API server, which the node agent does not serve (it waited for ever)
        scheduler_service_type="NodePort",
    )
    (scheduler,) = spec["spec"]["scheduler"]["spec"]["containers"]
    scheduler["args"] = [
        sys.executable,
        "-m",
        "distributed.cli.dask_scheduler",
        "--host",
        "0.0.0.0",
    ]
    (worker,) = spec["spec"]["worker"]["spec"]["containers"]
    worker["resources"] = {"limits": {KUBE_SHARE_RESOURCE: "1"}}
    return spec


class KubeRunning:
    def __init__(self, n: int, seq: int, namespace: str) -> None:
        from dask_kubernetes.operator import KubeCluster
        from distributed import Client

        self.name = f"{STOCK_PREFIX}{seq}"
        self.namespace = namespace
        self.cluster = KubeCluster(
            custom_cluster_spec=stock_cluster_spec(self.name, n),
            namespace=namespace,
            shutdown_on_close=True,
            quiet=True,
        )
        self.client = Client(self.cluster)

    def scale(self, n: int) -> None:
        self.cluster.scale(n)

    def count(self) -> int:
        return len(scheduler_workers(self.client))

    def record(self) -> None:
        pass  # pods run in namespaces of their own: the pods are what is looked for

    def settle(self) -> None:
        pass

    def close(self) -> Leftovers:
        self.client.close()
        self.cluster.close()
        return Leftovers(
            pods=[(self.namespace, f"{CLUSTER_LABEL}={self.name}")], shut_at=time.time()
        )


class KubeAnchor:
    name = "anchor"

    def __init__(
        self,
        namespace: str,
        pods: Callable[[str, str], list[str]],
        delete_cluster: Callable[[str, str], None],
    ) -> None:
        self.label = f"dask-kubernetes {version('dask_kubernetes')} KubeCluster (stock)"
        self.namespace = namespace
        self.pods = pods
        self.delete_cluster = delete_cluster
        self.seq = 0

    def up(self, n: int) -> Running:
        self.seq += 1
        try:
            return KubeRunning(n, self.seq, self.namespace)
        except BaseException:
            # a KubeCluster that failed to start leaves its DaskCluster (and pods) behind
            from dask_kubernetes.operator import KubeCluster

            name = f"{STOCK_PREFIX}{self.seq}"
            with suppress(Exception):
                self.delete_cluster(self.namespace, name)
            # deleted here: its exit-time reaper would try again once the dev cluster is gone
            for instance in list(KubeCluster._instances):
                if getattr(instance, "name", None) == name:
                    KubeCluster._instances.discard(instance)
            raise

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        lines = [
            f"pod {ns}/{pod} still there"
            for s in left
            for ns, selector in s.pods
            for pod in self.pods(ns, selector)
        ]
        return len(lines), lines


class GpulabKube(GpulabLocal):
    label = "gpulab (hub-owned, Kubernetes backend)"

    def __init__(self, api: GpulabClusters, pods: Callable[[str, str], list[str]]) -> None:
        super().__init__(api, account_uid=-1)
        self.pods = pods

    def leaked(self, left: list[Leftovers]) -> tuple[int, list[str]]:
        # every pod of a Dask cluster in any namespace but the stock ones: the user's clusters
        # are the only ones gpulab's hub runs on this private dev cluster
        selector = CLUSTER_LABEL
        lines = [
            f"pod {pod} still there"
            for pod in self.pods("", selector)
            if not pod.split("/", 1)[1].startswith(STOCK_PREFIX)
        ]
        return len(lines), lines


def run_kube(  # pragma: no cover
    root: Path, n: int, rounds: int, leak_wait: float, anchor: bool = True
) -> Backend:
    """Both Kubernetes sides on a private dev cluster with the dask-kubernetes operator (the
    CRDs and operator process as gpulab runs them; see ``kube_unavailable``)."""
    from tests.harness.cluster import running_dev_cluster
    from tests.harness.dask_kube import running_dask_operator
    from tests.harness.hub import Hub, merged
    from tests.harness.jobs import user_client
    from tests.harness.kube import KUBE_HUB_OVERLAY, kube_hub_overlay

    backend = Backend("kube")
    with (
        running_dev_cluster(root / "dev-cluster", [kube_node()]) as cluster,
        running_dask_operator(cluster, root / "dask-operator.log"),
    ):
        os.environ.update(cluster.env())  # the stock KubeCluster finds the cluster by it

        def pods(namespace: str, selector: str) -> list[str]:
            path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
            found = cluster.api("GET", f"{path}?labelSelector={selector}")
            return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in found["items"]]

        def delete_cluster(namespace: str, name: str) -> None:
            group = "/apis/kubernetes.dask.org/v1"
            cluster.api("DELETE", f"{group}/namespaces/{namespace}/daskclusters/{name}")

        overlay = kube_hub_overlay(cluster, merged(KUBE_HUB_OVERLAY, KUBE_OVERLAY))
        hub = Hub(root / "gpulab-kube", overlay)
        try:
            hub.start()
            hub.create_user(USER)
            token = user_client(hub, USER).headers["Authorization"].removeprefix("token ")
            creds = root / "kube-credentials"
            creds.mkdir(mode=0o700)
            api = GpulabClusters(hub.url, token, USER, creds, KUBE_PROFILE)
            if anchor:
                backend.sides.append(KubeAnchor("default", pods, delete_cluster))
            else:
                backend.missing["anchor"] = "--no-kube-anchor"
            backend.sides.append(GpulabKube(api, pods))
            measure(backend, n, rounds, leak_wait)
        except BaseException:
            print(hub.log()[-3000:], file=sys.stderr)
            operator_log = root / "dask-operator.log"
            print(operator_log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            hub.close()
            hub.cleanup()
    return backend
