"""Kubernetes manifests of a gpulab Dask cluster, as pure builders (dicts in, dicts out; no client).

The dask-kubernetes operator (`dask_operator`) turns them into pods: a `DaskCluster` becomes the
scheduler's Deployment and Service (and a default `DaskWorkerGroup`, kept at 0 replicas: gpulab
admits each worker on its own), and each `DaskWorkerGroup` one Deployment per replica. gpulab
makes one worker group of one replica per admitted worker, named after the worker
(`<cluster>-w<n>`), whose pod is a job pod in all that matters to the cluster and the hub
(`job_objects`):

- GPUs: the resources of the sharing backend for the share the allocator chose, the required
  node affinity that pins it to the allocator's node, the spot toleration and the priority class
  (`gpu_resources.placed_pod`, through `GPUKubeSpawner.placed_job_pod`), and the placement
  annotation, so the hub's cluster view counts it and a restarted hub rebuilds its allocation;
  the share's variables (GPULAB_GPU_FRACTION, ...) in its environment;
- hardening: the servers' security contexts (non-root uid/gid, fsGroup, seccomp, no privilege
  escalation, no capabilities), no service account token, no service links.

TLS. The cluster's `ClusterTLS` (one self-signed certificate that is its own CA) is a Secret of
the owner's namespace, mounted read-only (0440, group fsGroup) into the scheduler and the workers,
and named to distributed by `DASK_DISTRIBUTED__COMM__*` variables (paths, not the key): the
scheduler requires mutual TLS, so a pod that reaches its port without the key cannot connect.
Only the hub (its service account) and the cluster's own pods read the Secret; the owner gets
the same material from the hub's REST API.

Network. `dask_network_policy`: the cluster's pods accept connections only from each other, the
owner's pods (her servers, jobs and other clusters' pods: label `hub.jupyter.org/username`) and
the hub, and reach only each other, DNS and (as servers) the internet without private ranges;
`dask_client_network_policy` lets the owner's pods reach her cluster (the servers' own policy
allows no private address). Another tenant's pod is refused by the scheduler's ingress rules
before TLS is even tried. Where the hub runs gpulab-metrics, the cluster's pods also reach the
hub (its pods or `hub_cidrs`) on the metrics service's push port, and on no other port of it:
workers push their GPU figures there.

GPU report. A worker holding a GPU share gets the hub's report for it (`gpulab.hub.report_tokens`:
the push URL, a token worth only reporting for that worker, its name and owner) from a Secret of
its own (`report_secret_manifest`, `<cluster>-w<n>-report`), through `valueFrom.secretKeyRef`:
the token is never a literal of the DaskWorkerGroup or its pod, which the operator copies into a
Deployment and whose specs more people and controllers read than the Secret. The Secret is
owned by the worker group once it exists (`report_owner_patch`: the garbage collector deletes it
with the group) and deleted by the executor with the worker's pods; the token itself is revoked
when the worker's share is given back.

Names. A cluster's objects are `gpulab-dask-<owner>-<id>` (cut, with a hash, to fit the
operator's 53-character cluster names), `...-scheduler` (the operator's Deployment and Service),
`...-default` (its default worker group) and `...-w<n>` (worker n, `worker_name(n)`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.dask.model import worker_name
from gpulab.spawner.kube.gpu_resources import PlacedPod
from gpulab.spawner.kube.objects import (
    CLOUD_METADATA_IP,
    MANAGED_BY,
    container_security_context,
    dns_egress,
    dns_name,
    internet_egress,
    placement_annotation,
    pod_security_context,
    safe_label_value,
)
from gpulab.spawner.names import (
    DASK_CLUSTER_LABEL,
    DASK_COMPONENT,
    DASK_WORKER_LABEL,
    HOSTNAME_LABEL,
    PLACEMENT_ANNOTATION,
    PRIORITY_LABEL,
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
SCHEDULER_CONTAINER = "scheduler"
WORKER_CONTAINER = "worker"
#: the module that starts a worker (dask-cuda's where the pod holds a GPU share)
WORKER_MODULE = "gpulab.spawner.singleuser.dask_worker"


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


# -- pieces ----------------------------------------------------------------------------------------


def tls_environment() -> list[dict[str, str]]:
    """distributed's configuration for mutual TLS with the cluster's certificate (its own CA) as
    scheduler, worker and client: paths into the Secret's volume, never the key itself."""
    cert, key = f"{TLS_DIR}/{TLS_CERT_KEY}", f"{TLS_DIR}/{TLS_KEY_KEY}"
    env = {
        "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
        "DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME": "tls",
        "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": cert,
    }
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT"] = cert
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY"] = key
    return [{"name": k, "value": v} for k, v in env.items()]


def tls_secret_manifest(
    owner: str, cluster_id: int, cert_pem: str, key_pem: str, settings: KubeDaskSettings
) -> dict[str, Any]:
    """The cluster's TLS Secret (kubernetes.io/tls, immutable) in the owner's namespace."""
    name = cluster_name(owner, cluster_id)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "immutable": True,
        "metadata": {
            "name": tls_secret_name(name),
            "namespace": settings.namespace,
            "labels": dask_labels(owner, cluster_id, settings.labels),
            "annotations": {USERNAME_LABEL: owner},
        },
        "data": {
            TLS_CERT_KEY: base64.b64encode(cert_pem.encode()).decode(),
            TLS_KEY_KEY: base64.b64encode(key_pem.encode()).decode(),
        },
    }


def report_secret_manifest(
    owner: str,
    cluster_id: int,
    number: int,
    report: Mapping[str, str],
    settings: KubeDaskSettings,
) -> dict[str, Any]:
    """Worker `number`'s GPU report (Opaque, immutable), one key per variable, in the owner's
    namespace. As with the TLS Secret, only the hub (its service account) and the pod that
    references it read it: users hold no Kubernetes permission (their pods mount no service
    account token), and every pod spec is the hub's, naming only its own workload's Secrets.
    Create it before the worker group (its pod needs it to start), then `report_owner_patch`
    once the group exists."""
    name = cluster_name(owner, cluster_id)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": report_secret_name(name, number),
            "namespace": settings.namespace,
            "labels": dask_labels(owner, cluster_id, settings.labels, worker=number),
            "annotations": {USERNAME_LABEL: owner},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(report.items())},
    }


def report_environment(secret_name: str, keys: Sequence[str]) -> list[dict[str, Any]]:
    """The worker container's report variables, each a reference to its key of the report's
    Secret, never its value (see the module docstring)."""
    return [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": k}}}
        for k in sorted(keys)
    ]


def report_owner_patch(group: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that makes the created worker `group` (with its uid) the owner of its
    report's Secret, so the garbage collector deletes the Secret with the group."""
    meta = group["metadata"]
    if not meta.get("uid"):
        raise ValueError(f"DaskWorkerGroup {meta.get('name')!r} has no uid: patch it once made")
    reference = {
        "apiVersion": DASK_API,
        "kind": "DaskWorkerGroup",
        "name": meta["name"],
        "uid": meta["uid"],
    }
    return {"metadata": {"ownerReferences": [reference]}}


def _security(settings: KubeDaskSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's and the container's security contexts, as a server's (KubeSpawner's make_pod
    plus gpulab's hardening) and a job's."""
    psc: dict[str, Any] = {} if settings.fs_gid is None else {"fsGroup": settings.fs_gid}
    psc.update(
        pod_security_context(run_as_non_root=settings.run_as_non_root, seccomp=settings.seccomp)
    )
    csc: dict[str, Any] = {}
    if settings.uid is not None:
        csc["runAsUser"] = settings.uid
    if settings.gid is not None:
        csc["runAsGroup"] = settings.gid
    csc["allowPrivilegeEscalation"] = False
    csc.update(
        container_security_context(
            run_as_non_root=settings.run_as_non_root,
            seccomp=settings.seccomp,
            drop_capabilities=settings.drop_capabilities,
        )
    )
    return psc, csc


def _pod_spec(container: dict[str, Any], name: str, settings: KubeDaskSettings) -> dict[str, Any]:
    psc, csc = _security(settings)
    container["securityContext"] = csc
    container["volumeMounts"] = [{"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}]
    if settings.image_pull_policy:
        container["imagePullPolicy"] = settings.image_pull_policy
    return {
        "automountServiceAccountToken": False,
        # no variables of the namespace's services (the hub's among them) in the pod's env
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": psc,
        "containers": [container],
        "volumes": [
            {
                "name": TLS_VOLUME,
                "secret": {
                    "secretName": tls_secret_name(name),
                    # group-owned by fsGroup (the kubelet's rule for Secret volumes): the
                    # non-root process reads it; without an fsGroup nobody else is in the pod
                    "defaultMode": 0o440 if settings.fs_gid is not None else 0o444,
                },
            }
        ],
    }


def _resources(cpu_milli: int, memory_mib: int, extra: Mapping[str, str]) -> dict[str, Any]:
    limits: dict[str, str] = {}
    if cpu_milli:
        limits["cpu"] = f"{cpu_milli}m"
    if memory_mib:
        limits["memory"] = f"{memory_mib}Mi"
    limits.update(extra)
    return {"limits": dict(limits), "requests": dict(limits)}


def _node_affinity(terms: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


# -- the cluster -----------------------------------------------------------------------------------


def dask_cluster_manifest(
    owner: str,
    cluster_id: int,
    *,
    placement: Placement,
    settings: KubeDaskSettings,
    priority_class_name: str = "",
) -> dict[str, Any]:
    """The `DaskCluster` of cluster `cluster_id`: its scheduler pod (no GPU; the CPU and memory
    of `placement`, the scheduler's allocation, on its node, with its placement annotation),
    mutual TLS from the cluster's Secret, a ClusterIP Service, and the operator's default worker
    group at 0 replicas (its pod spec is never run: workers are `dask_worker_group_manifest`s)."""
    name = cluster_name(owner, cluster_id)
    labels = dask_labels(owner, cluster_id, settings.labels)
    request = placement.request
    container: dict[str, Any] = {
        "name": SCHEDULER_CONTAINER,
        "image": settings.image,
        "command": [
            settings.python,
            "-m",
            "distributed.cli.dask_scheduler",
            "--protocol",
            "tls",
            "--port",
            str(SCHEDULER_PORT),
            "--dashboard-address",
            f":{DASHBOARD_PORT}",
        ],
        "env": [
            {"name": "LANG", "value": "C.UTF-8"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *tls_environment(),
        ],
        "ports": [
            {"name": "tcp-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
            {"name": "http-dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"},
        ],
        "resources": _resources(request.cpu_milli, request.memory_mib, {}),
        # Ready once it listens (the dashboard's port: a probe of the TLS port would fail a
        # handshake each time); the hub checks a TLS handshake itself
        "readinessProbe": {
            "tcpSocket": {"port": "http-dashboard"},
            "periodSeconds": 1,
            "failureThreshold": 3,
        },
    }
    scheduler_spec = _pod_spec(container, name, settings)
    scheduler_spec["affinity"] = _node_affinity(
        [
            {
                "matchExpressions": [
                    {"key": HOSTNAME_LABEL, "operator": "In", "values": [placement.node]}
                ]
            }
        ]
    )
    if priority_class_name:
        scheduler_spec["priorityClassName"] = priority_class_name
    worker_spec = _pod_spec(
        {"name": WORKER_CONTAINER, "image": settings.image, "command": ["false"]}, name, settings
    )
    return {
        "apiVersion": DASK_API,
        "kind": "DaskCluster",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": labels,
            "annotations": {USERNAME_LABEL: owner},
        },
        "spec": {
            "idleTimeout": 0,  # idle rules are the hub's (gpulab.hub.dask.lifecycle)
            "scheduler": {
                "metadata": {
                    "labels": {**labels, PRIORITY_LABEL: request.priority},
                    "annotations": {PLACEMENT_ANNOTATION: placement_annotation(placement)},
                },
                "spec": scheduler_spec,
                "service": {
                    "type": "ClusterIP",
                    "selector": {
                        OPERATOR_CLUSTER_LABEL: name,
                        OPERATOR_COMPONENT_LABEL: "scheduler",
                    },
                    "ports": [
                        {
                            "name": "tcp-comm",
                            "protocol": "TCP",
                            "port": SCHEDULER_PORT,
                            "targetPort": "tcp-comm",
                        },
                        {
                            "name": "http-dashboard",
                            "protocol": "TCP",
                            "port": DASHBOARD_PORT,
                            "targetPort": "http-dashboard",
                        },
                    ],
                },
            },
            "worker": {"replicas": 0, "spec": worker_spec},
        },
    }


def worker_command(
    python: str,
    *,
    scheduler_address: str,
    number: int,
    holds_gpu: bool,
    nthreads: int,
    memory_mib: int,
) -> list[str]:
    """The worker's command: gpulab's launcher (dask-cuda's worker where the pod holds a GPU
    share and dask_cuda is installed, a plain `distributed` worker otherwise; it says which in
    the log) with the arguments both take."""
    command = [python, "-m", WORKER_MODULE]
    if holds_gpu:
        command.append("--gpu")
    command += [
        "--",
        scheduler_address,
        "--name",
        worker_name(number),
        "--nthreads",
        str(nthreads),
        "--memory-limit",
        f"{memory_mib}MiB" if memory_mib else "auto",
        "--no-dashboard",
    ]
    return command


def dask_worker_group_manifest(
    owner: str,
    cluster_id: int,
    number: int,
    *,
    placement: Placement,
    pod: PlacedPod,
    scheduler_address: str,
    cpu_milli: int,
    memory_mib: int,
    settings: KubeDaskSettings,
    environment: Mapping[str, str] | None = None,
    report_keys: Sequence[str] = (),
) -> dict[str, Any]:
    """The `DaskWorkerGroup` of worker `number`: one replica whose pod holds `placement` (the
    worker's allocation) as a job pod would (`pod`: `GPUKubeSpawner.placed_job_pod(profile,
    placement)`; `cpu_milli`/`memory_mib`: the profile's limits), and runs a worker named
    `worker_name(number)` that joins `scheduler_address` (`tls://...`) with the cluster's TLS.
    `environment`: the cluster spec's variables (ClusterSpec refuses the names gpulab sets, which
    come after them and win). They are in the worker group's pod spec, which the hub and the
    namespace's admins read, never another tenant. `report_keys`: the variables of the worker's
    GPU report, read from its Secret (`report_secret_manifest`) by reference only."""
    name = cluster_name(owner, cluster_id)
    labels = dask_labels(owner, cluster_id, settings.labels, worker=number)
    env: dict[str, dict[str, Any]] = {}
    for key, value in (
        ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"),
        *sorted((environment or {}).items()),
        *pod.environment.items(),
    ):
        env[key] = {"name": key, "value": value}
    for entry in tls_environment():
        env[entry["name"]] = entry
    for entry in report_environment(report_secret_name(name, number), report_keys):
        env[entry["name"]] = entry
    threads = max(1, -(-cpu_milli // 1000)) if cpu_milli else 1
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": settings.image,
        "command": worker_command(
            settings.python,
            scheduler_address=scheduler_address,
            number=number,
            holds_gpu=bool(placement.gpus),
            nthreads=threads,
            memory_mib=memory_mib,
        ),
        "env": list(env.values()),
        "resources": _resources(cpu_milli, memory_mib, pod.gpu.limits),
    }
    spec = _pod_spec(container, name, settings)
    if pod.gpu.node_affinity_required:
        spec["affinity"] = _node_affinity(pod.gpu.node_affinity_required)
    if pod.gpu.tolerations:
        spec["tolerations"] = list(pod.gpu.tolerations)
    if pod.gpu.priority_class_name:
        spec["priorityClassName"] = pod.gpu.priority_class_name
    return {
        "apiVersion": DASK_API,
        "kind": "DaskWorkerGroup",
        "metadata": {
            "name": worker_group_name(name, number),
            "namespace": settings.namespace,
            "labels": labels,
            "annotations": {USERNAME_LABEL: owner},
        },
        "spec": {
            "cluster": name,
            "worker": {
                "replicas": 1,
                "metadata": {
                    "labels": {**labels, PRIORITY_LABEL: placement.request.priority},
                    "annotations": {
                        USERNAME_LABEL: owner,
                        PLACEMENT_ANNOTATION: placement_annotation(placement),
                    },
                },
                "spec": spec,
            },
        },
    }


# -- network ---------------------------------------------------------------------------------------


def dask_network_policy(owner: str, cluster_id: int, settings: KubeDaskSettings) -> dict[str, Any]:
    """The cluster's pods (scheduler and workers) accept connections only from each other, the
    owner's pods and the hub; they reach each other, DNS and what servers reach (the internet
    without private ranges and the cloud metadata address). Another tenant's pods match none of
    the ingress peers (they carry another `hub.jupyter.org/username`)."""
    name = cluster_name(owner, cluster_id)
    cidrs = list(settings.hub_cidrs)
    members = {"podSelector": {"matchLabels": {OPERATOR_CLUSTER_LABEL: name}}}
    # as servers: DNS and the internet, never private ranges besides the cluster's own pods
    egress: list[dict[str, Any]] = [{"to": [members]}, dns_egress()]
    if settings.hub_push_ports:
        # workers -> gpulab-metrics' push port (their GPU reports), as servers and job pods push;
        # nothing else of the hub's pod or machine. A push needs a token the service checks
        # against the worker's own allocation, so the scheduler reaching it gains nothing.
        egress.append(
            {
                "ports": [
                    {"port": port, "protocol": "TCP"}
                    for port in sorted(set(settings.hub_push_ports))
                ],
                "to": [
                    {"podSelector": {"matchLabels": dict(settings.hub_selector)}},
                    *[{"ipBlock": {"cidr": c}} for c in cidrs],
                ],
            }
        )
    if settings.allow_internet:
        egress.append(internet_egress(settings.cloud_metadata_ip))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(name),
            "namespace": settings.namespace,
            "labels": {**MANAGED_BY, "component": "gpulab-dask-network-policy"},
        },
        "spec": {
            "podSelector": {"matchLabels": {OPERATOR_CLUSTER_LABEL: name}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        members,
                        {"podSelector": {"matchLabels": {USERNAME_LABEL: safe_label_value(owner)}}},
                        {"podSelector": {"matchLabels": dict(settings.hub_selector)}},
                        *[{"ipBlock": {"cidr": c}} for c in cidrs],
                    ]
                }
            ],
            "egress": egress,
        },
    }


def dask_client_network_policy(
    owner: str, cluster_id: int, settings: KubeDaskSettings
) -> dict[str, Any]:
    """Egress of the owner's pods (her servers and jobs, whose own policy allows no private
    address) to her cluster's pods; policies add up, so this opens that and nothing else."""
    name = cluster_name(owner, cluster_id)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": client_network_policy_name(name),
            "namespace": settings.namespace,
            "labels": {**MANAGED_BY, "component": "gpulab-dask-network-policy"},
        },
        "spec": {
            "podSelector": {"matchLabels": {USERNAME_LABEL: safe_label_value(owner)}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {"matchLabels": {OPERATOR_CLUSTER_LABEL: name}}}]}],
        },
    }


__all__ = [
    "KubeDaskSettings",
    "client_network_policy_name",
    "cluster_name",
    "dask_client_network_policy",
    "dask_cluster_manifest",
    "dask_labels",
    "dask_network_policy",
    "dask_worker_group_manifest",
    "network_policy_name",
    "report_environment",
    "report_owner_patch",
    "report_secret_manifest",
    "report_secret_name",
    "scheduler_name",
    "tls_secret_manifest",
    "tls_secret_name",
    "worker_command",
    "worker_group_name",
]
