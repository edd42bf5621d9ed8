"""Kubernetes pieces the dev-cluster tests, the GPUKubeSpawner tests and the benchmarks share: the
session cluster's nodes, pod manifests, blocking REST helpers over a cluster, and the config of a
hub that spawns onto one (so `python -m bench.isolation` measures what the kube tests assert).

The first session on a machine builds the Kubernetes binaries (~10 min on 2 cores) into
~/.cache/gpulab (or $GPULAB_KUBE_CACHE); later sessions start a cluster in ~10 s.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import sys
import threading
import urllib.error
import uuid
from collections.abc import Iterator
from typing import Any

from traitlets.config import Config

from gpulab.devcluster import DevCluster, NodeSpec
from tests.harness.hub import merged
from tests.harness.ports import free_port
from tests.harness.wait import wait_for

# -- the session cluster (tests/devcluster) ------------------------------------------------------

# gpu-a: the scheduler test's 8 GPUs; gpu-b: one MIG-enabled and one time-sliced GPU;
# gpu-fail: the node the failure test stops; gpu-spot: a tainted spot node
KUBE_NODES = [
    NodeSpec("gpu-a", gpus=8, zone="zone-a", rack="rack-1"),
    NodeSpec(
        "gpu-b",
        gpus=2,
        gpu_product="NVIDIA-H100-80GB-HBM3",
        zone="zone-b",
        rack="rack-2",
        mig={"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2},
        mig_gpus=1,
        sharing="time-slicing",
    ),
    NodeSpec("gpu-fail", gpus=1, zone="zone-c", rack="rack-3"),
    NodeSpec("gpu-spot", gpus=4, zone="zone-b", rack="rack-4", spot=True),
]


# a pod's command (python -c): tries each "host:port" given and prints
# {target: "open" | "refused" | "error ..."}
CONNECT_SCRIPT = r"""
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        out[target] = "open"
    except ConnectionRefusedError:
        out[target] = "refused"
    except OSError as e:
        out[target] = f"error {e}"
print(json.dumps(out), flush=True)
"""


@contextlib.contextmanager
def host_http_server(ip: str) -> Iterator[int]:
    """An HTTP server of this machine (a host process, like the hub) on ip; its port."""
    server = http.server.HTTPServer((ip, 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


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
    """A one-container Pod running `command` (the node agent runs it as a process)."""
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


@contextlib.contextmanager
def fresh_namespace(
    cluster: DevCluster, labels: dict[str, str] | None = None, prefix: str = "test"
) -> Iterator[Kube]:
    """A Kube in a new namespace (with `labels`: Pod Security's, say) whose default
    ServiceAccount exists (pods can start); what it made and the namespace are deleted on exit."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})

    def service_account_ready() -> bool:
        try:
            sa = cluster.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
        except urllib.error.HTTPError:
            return False
        # made by the service-account controller; its pods' tokens are projected ones from the
        # TokenRequest API (1.24+ makes no token Secret)
        return bool(sa.get("metadata", {}).get("name"))

    wait_for(f"namespace {name}'s default ServiceAccount", service_account_ready, 60)
    k = Kube(cluster, name)
    try:
        yield k
    finally:
        k.close()
        cluster.api("DELETE", f"/api/v1/namespaces/{name}")


def container_state(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["status"]["containerStatuses"][0]["state"]


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:3000]


# -- a hub with GPUKubeSpawner (tests/spawner/kube, bench.isolation) ------------------------------

# gk-a100: whole GPUs; one node per way of cutting a GPU, as a GPU operator configures nodes
SPAWNER_NODES = [
    NodeSpec("gk-a100", gpus=8, zone="zone-a", rack="rack-1"),
    NodeSpec(
        "gk-a100-mig",
        gpus=1,
        zone="zone-a",
        rack="rack-1",
        mig={"2g.20gb": 3, "1g.10gb": 1},
    ),
    NodeSpec(
        "gk-a100-ts", gpus=1, zone="zone-a", rack="rack-1", sharing="time-slicing", replicas=4
    ),
    # another model, so that its GPU (HAMi also hands it out whole) is not a ninth A100
    NodeSpec(
        "gk-l40s-hami",
        gpus=1,
        gpu_product="NVIDIA-L40S",
        gpu_memory_mib=46068,
        zone="zone-a",
        rack="rack-1",
        sharing="hami",
        replicas=4,
    ),
    NodeSpec(
        "gk-t4", gpus=1, gpu_product="NVIDIA-T4", gpu_memory_mib=15360, zone="zone-b", rack="rack-2"
    ),
]

SPAWNER_PROFILES = [
    {"slug": "cpu", "gpus": 0, "default": True},
    {"slug": "a100-quarter", "gpus": "1/4", "gpu_model": "A100-SXM4-80GB"},
    {"slug": "a100-eighth", "gpus": "1/8", "gpu_model": "A100-SXM4-80GB"},
    {"slug": "l40s-eighth", "gpus": "1/8", "gpu_model": "L40S"},
    {"slug": "a100-1", "gpus": 1, "gpu_model": "A100-SXM4-80GB"},
    {"slug": "a100-4", "gpus": 4, "gpu_model": "A100-SXM4-80GB"},
    {"slug": "a100-spot-8", "gpus": 8, "gpu_model": "A100-SXM4-80GB", "priority": "preemptible"},
    {"slug": "t4-1", "gpus": 1, "gpu_model": "T4"},
]

KUBE_HUB_OVERLAY = Config(
    {
        "JupyterHub": {"spawner_class": "gpulab-kube"},
        "GPUKubeSpawner": {
            "namespace": "default",
            "image": "gpulab/singleuser:dev",  # not pulled: the node agent runs cmd
            "start_timeout": 120,
            "http_timeout": 90,
            "delete_grace_period": 5,
            "node_failure_seconds": 2,
            "gpu_sharing": "mig",
            "prestop_command": [sys.executable, "-m", "gpulab.spawner.singleuser.prestop"],
        },
        "GPUCapacity": {
            "profiles": SPAWNER_PROFILES,
            # these tests are about the cluster's capacity, not quotas
            "default_user_quota_gpus": 8,
        },
    }
)

#: KUBE_HUB_OVERLAY with workspaces: the home prepared by the pod itself, snapshots
KUBE_WORKSPACE_OVERLAY = merged(
    KUBE_HUB_OVERLAY,
    Config(
        {
            "GPUKubeSpawner": {
                "workspace_prepare_command": [
                    sys.executable,
                    "-m",
                    "gpulab.spawner.singleuser.checkpoint.prepare",
                ],
                "snapshot_timeout_seconds": 60,
            }
        }
    ),
)


def kube_hub_overlay(cluster: DevCluster, overlay: Config = KUBE_HUB_OVERLAY) -> Config:
    """`overlay` for a hub on this machine whose servers run in `cluster`'s pods. A pod's
    127.0.0.1 is its own, so the hub API and gpulab-metrics (where servers push) listen on the
    host's address on the pod network, and the servers' NetworkPolicy admits the hub and proxy
    by that address (the source of this machine's connections to pods)."""
    host = cluster.host_address
    return merged(
        overlay,
        Config(
            {
                "JupyterHub": {"hub_ip": host},
                "GPULab": {"metrics_service_url": f"http://{host}:{free_port(host)}"},
                "GPUKubeSpawner": {"network_policy_hub_cidrs": [f"{host}/32"]},
            }
        ),
    )


def placed_pods(cluster: DevCluster) -> list[dict[str, Any]]:
    """The pods of gpulab servers (those with a placement annotation) in namespace default."""
    return [
        p
        for p in cluster.api("GET", "/api/v1/namespaces/default/pods")["items"]
        if "gpulab.io/placement" in (p["metadata"].get("annotations") or {})
    ]


def placed_pod_of(cluster: DevCluster, user: str) -> dict[str, Any]:
    """`user`'s one placed pod."""
    (pod,) = [
        p
        for p in placed_pods(cluster)
        if p["metadata"]["annotations"].get("hub.jupyter.org/username") == user
    ]
    return pod
