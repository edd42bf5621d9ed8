"""The dask-kubernetes operator on a dev cluster, as gpulab runs it: the CRDs applied with their
`$ref`s resolved against the cluster's own OpenAPI (`gpulab.spawner.kube.dask_operator`), and the
operator's process (`kopf run -m dask_kubernetes.operator.controller --all-namespaces`) with the
cluster's kubeconfig; stopped (SIGTERM, then SIGKILL) when the context ends.

And what tests/spawner/kube/test_dask.py needs beside its dev cluster: an owner's backend as
`GPUKubeSpawner.dask_target` builds it (`Backend`), the PriorityClasses placed pods name, a
profile's allocator request, the cluster's pods, TLS files and a probe pod's connection; here so
that the test module holds its scenarios only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpulab.devcluster import DevCluster
from gpulab.hub.allocator import Allocator, Placement, Request
from gpulab.hub.daskservice.executor import ClusterTLS
from gpulab.hub.profiles import Profile, parse_profile
from gpulab.spawner.kube.dask import KubeDaskTarget
from gpulab.spawner.kube.dask_operator import install_crds, operator_command
from gpulab.spawner.kube.dask_settings import KubeDaskSettings
from gpulab.spawner.kube.gpu_resources import PlacedPod, placed_pod
from gpulab.spawner.kube.nodes import inventory_from_nodes
from gpulab.spawner.kube.objects import priority_class_manifest
from tests.harness.kube import CONNECT_SCRIPT, pod_manifest
from tests.harness.wait import wait_for


def apply_operator_crds(cluster: DevCluster) -> list[str]:
    async def run() -> list[str]:
        api = await cluster.api_client()
        try:
            return await install_crds(api)
        finally:
            await api.close()

    return asyncio.run(run())


@contextlib.contextmanager
def running_dask_operator(cluster: DevCluster, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The CRDs applied and the operator running against `cluster`; its log in `log_path`."""
    apply_operator_crds(cluster)
    env = {**os.environ, **cluster.env()}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            operator_command(), env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while b"Initial authentication has finished" not in log_path.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the dask operator did not start: {log_path.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


QUARTER = {"slug": "a100-quarter", "gpus": "1/4", "gpu_model": "A100-SXM4-80GB", "cpu_limit": 1}
CPU = {"slug": "cpu", "cpu_limit": 1}
NAMESPACE = "default"


def ensure_priority_classes(cluster: DevCluster) -> None:
    """The PriorityClasses placed pods name, as GPUKubeSpawner creates them on first use."""
    for priority, (name, value) in {
        "on-demand": ("gpulab-on-demand", 1000),
        "preemptible": ("gpulab-preemptible", 100),
    }.items():
        with contextlib.suppress(urllib.error.HTTPError):  # 409: made by an earlier module
            cluster.api(
                "POST",
                "/apis/scheduling.k8s.io/v1/priorityclasses",
                priority_class_manifest(name, value, priority),
            )


def node_objects(cluster: DevCluster) -> list[dict[str, Any]]:
    return list(cluster.api("GET", "/api/v1/nodes")["items"])


class Backend:
    """An owner's backend as GPUKubeSpawner.dask_target builds it, for one sharing backend."""

    def __init__(
        self,
        cluster: DevCluster,
        sharing: str,
        priority_classes: dict[str, str] | None = None,
        start_timeout: float = 120,
    ) -> None:
        self.cluster, self.sharing = cluster, sharing
        self.priority_classes, self.start_timeout = priority_classes, start_timeout
        self.inventory = inventory_from_nodes(node_objects(cluster), sharing)
        self.allocator = Allocator(self.inventory)
        self.profiles = {"a100-quarter": parse_profile(QUARTER), "cpu": parse_profile(CPU)}
        self.api: Any = None

    def gpu(self, uuid: str) -> Any:
        return next(g for n in self.inventory.nodes for g in n.gpus if g.uuid == uuid)

    def placed(self, profile: Profile, placement: Placement) -> PlacedPod:
        device = self.gpu(placement.gpus[0].uuid) if placement.gpus else None
        return placed_pod(
            profile,
            placement,
            sharing=self.sharing,
            priority=placement.request.priority,
            device=device,
            gpu_memory_mib=81920,
            priority_classes=self.priority_classes,
        )

    async def target(self, owner: str) -> KubeDaskTarget:
        if self.api is None:
            self.api = await self.cluster.api_client()
        host = self.cluster.host_address
        return KubeDaskTarget(
            api_client=self.api,
            settings=KubeDaskSettings(
                namespace=NAMESPACE,
                image="gpulab/singleuser:dev",  # not pulled: the node agent runs the command
                python=sys.executable,
                termination_grace_seconds=5,
                hub_cidrs=(f"{host}/32",),  # this process is the hub, outside the cluster
            ),
            profile=self.profiles.get,
            placed_pod=self.placed,
            priority_class=lambda priority: "",
            node_failure_seconds=2,
            start_timeout=self.start_timeout,
        )


def profile_request(profile: Profile) -> Request:
    """The profile's allocator request, as GPUCapacity.request_for makes it."""
    return Request(
        id="-",
        cpu_milli=round((profile.cpu_limit or 0) * 1000),
        memory_mib=profile.mem_limit_mib or 0,
        num_gpu=profile.num_gpu,
        gpu_milli=profile.gpu_milli,
        gpu_models=profile.gpu_models,
    )


def pods(cluster: DevCluster, selector: str) -> list[dict[str, Any]]:
    query = urllib.parse.quote(selector)
    path = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={query}"
    return list(cluster.api("GET", path)["items"])


def client_security(tls: ClusterTLS, folder: Path) -> Any:
    """distributed's Security for a client of the cluster: its certificate and key written to
    `folder` (the key 0600), mutual TLS required."""
    from distributed.security import Security

    cert, key = folder / "tls.crt", folder / "tls.key"
    cert.write_text(tls.cert_pem)
    key.write_text(tls.key_pem)
    key.chmod(0o600)
    return Security(
        tls_ca_file=str(cert),
        tls_client_cert=str(cert),
        tls_client_key=str(key),
        require_encryption=True,
    )


def connect_from_pod(cluster: DevCluster, name: str, labels: dict[str, str], target: str) -> str:
    """What a pod with `labels` gets connecting to `target` ("open", "refused", "error ...")."""
    manifest = pod_manifest(name, [sys.executable, "-c", CONNECT_SCRIPT, target])
    manifest["metadata"]["labels"] = labels
    cluster.api("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", manifest)
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}"
    try:
        wait_for(
            f"{name} to end",
            lambda: cluster.api("GET", path)["status"].get("phase") in ("Succeeded", "Failed"),
            60,
        )
        return str(json.loads(cluster.logs(name).strip().splitlines()[-1])[target])
    finally:
        cluster.api("DELETE", path, {"gracePeriodSeconds": 0})
