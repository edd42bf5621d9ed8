"""What every manifest of a gpulab Dask cluster shares: how its pods run (`KubeDaskSettings`),
the operator's API and labels, the cluster's ports and TLS paths, and its objects' names and labels.

Apart from the builders (`dask_objects`: the DaskCluster and the DaskWorkerGroups; `dask_secrets`:
the TLS and report Secrets; `dask_network`: the NetworkPolicies) because all of them and the
executor (`dask`) name the same objects: each imports the names from here, none from another.

Names. A cluster's objects are `gpulab-dask-<owner>-<id>` (cut, with a hash, to fit the
operator's 53-character cluster names), `...-scheduler` (the operator's Deployment and Service),
`...-default` (its default worker group) and `...-w<n>` (worker n, `worker_name(n)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpulab.hub.dask.allocations import worker_name
from gpulab.spawner.kube.objects import CLOUD_METADATA_IP, dns_name, safe_label_value
from gpulab.spawner.names import (
    DASK_CLUSTER_LABEL,
    DASK_COMPONENT,
    DASK_WORKER_LABEL,
    USERNAME_LABEL,
)

DASK_API = "kubernetes.dask.org/v1"
#: the operator's labels on what it makes of a DaskCluster / DaskWorkerGroup
OPERATOR_CLUSTER_LABEL = "dask.org/cluster-name"
OPERATOR_COMPONENT_LABEL = "dask.org/component"
OPERATOR_WORKERGROUP_LABEL = "dask.org/workergroup-name"
#: the operator's cluster names (its validation: 63 minus "-scheduler")
MAX_CLUSTER_NAME = 53
SCHEDULER_PORT = 8786
DASHBOARD_PORT = 8787
#: where the cluster's TLS Secret is mounted, and its keys (a kubernetes.io/tls Secret)
TLS_DIR = "/etc/gpulab/dask-tls"
TLS_VOLUME = "gpulab-dask-tls"
TLS_CERT_KEY = "tls.crt"
TLS_KEY_KEY = "tls.key"


@dataclass(frozen=True)
class KubeDaskSettings:
    """How the cluster runs Dask pods: the owner's namespace, the image (with gpulab and
    distributed installed, as server images), its Python, and the servers' hardening (the
    defaults are GPUKubeSpawner's). `hub_selector`/`hub_cidrs`: the hub's pod labels or, for a
    hub outside the cluster, its addresses (GPUKubeSpawner.network_policy_hub_labels /
    network_policy_hub_cidrs). `labels`: gpulab's common labels (e.g. `app`)."""

    namespace: str
    image: str
    python: str = "python3"
    uid: int | None = 1000
    gid: int | None = 100
    fs_gid: int | None = 100
    run_as_non_root: bool = True
    seccomp: str = "RuntimeDefault"
    drop_capabilities: tuple[str, ...] = ("ALL",)
    termination_grace_seconds: int = 20
    image_pull_policy: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    hub_selector: Mapping[str, str] = field(
        default_factory=lambda: {"app": "jupyterhub", "component": "hub"}
    )
    hub_cidrs: tuple[str, ...] = ()
    #: the gpulab-metrics push port(s) on the hub (GPUKubeSpawner's push URL, as servers' policy
    #: allows it); empty: the hub runs no gpulab-metrics, and the pods reach nothing of the hub
    hub_push_ports: tuple[int, ...] = ()
    allow_internet: bool = True
    cloud_metadata_ip: str = CLOUD_METADATA_IP


# -- names -----------------------------------------------------------------------------------------


def cluster_name(owner: str, cluster_id: int) -> str:
    """The DaskCluster's name: `gpulab-dask-<owner>-<id>`, a DNS label the operator accepts
    (the owner's part cut, with a hash of it, so that `-w<n>` and the operator's suffixes fit)."""
    suffix = f"-{cluster_id}"
    # room for "-w<n>" (6) and the operator's "-worker-<10 hex>" (18) within a 63-char label value
    limit = min(MAX_CLUSTER_NAME, 63 - 6 - 18) - len(suffix)
    prefix = dns_name(f"gpulab-dask-{owner}".replace(".", "-"), limit)
    return prefix + suffix


def scheduler_name(name: str) -> str:
    """The operator's scheduler Deployment and Service of cluster `name`."""
    return f"{name}-scheduler"


def worker_group_name(name: str, number: int) -> str:
    """The DaskWorkerGroup of worker `number`: `<cluster>-w<n>`."""
    return f"{name}-{worker_name(number)}"


def tls_secret_name(name: str) -> str:
    return f"{name}-tls"


def report_secret_name(name: str, number: int) -> str:
    """The Secret of worker `number`'s GPU report: `<cluster>-w<n>-report`."""
    return f"{worker_group_name(name, number)}-report"


def network_policy_name(name: str) -> str:
    return f"{name}-ingress"


def client_network_policy_name(name: str) -> str:
    return f"{name}-clients"


def dask_labels(
    owner: str, cluster_id: int, common: Mapping[str, str], worker: int | None = None
) -> dict[str, str]:
    """Labels of a cluster's objects (and its pods: the operator copies them onto what it makes):
    what the hub's executor and the NetworkPolicies select them by."""
    labels = {
        **common,
        "component": DASK_COMPONENT,
        USERNAME_LABEL: safe_label_value(owner),
        DASK_CLUSTER_LABEL: str(cluster_id),
    }
    if worker is not None:
        labels[DASK_WORKER_LABEL] = str(worker)
    return labels


__all__ = [
    "KubeDaskSettings",
    "client_network_policy_name",
    "cluster_name",
    "dask_labels",
    "network_policy_name",
    "report_secret_name",
    "scheduler_name",
    "tls_secret_name",
    "worker_group_name",
]
