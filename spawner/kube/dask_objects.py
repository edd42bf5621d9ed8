"""Kubernetes manifests of a gpulab Dask cluster's pods, as pure builders (dicts in, dicts out; no
client).

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

The cluster's Secrets (its TLS material, the workers' GPU reports) are built in `dask_secrets`,
its NetworkPolicies in `dask_network`, the names and settings all of them share in
`dask_settings`; the scheduler and the workers mount the TLS Secret and name it to distributed
by `DASK_DISTRIBUTED__COMM__*` variables (paths, not the key), and a GPU worker reads its report
by reference only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.dask.allocations import worker_name
from gpulab.spawner.kube.dask_secrets import report_environment
from gpulab.spawner.kube.dask_settings import (
    DASHBOARD_PORT,
    DASK_API,
    OPERATOR_CLUSTER_LABEL,
    OPERATOR_COMPONENT_LABEL,
    SCHEDULER_PORT,
    TLS_CERT_KEY,
    TLS_DIR,
    TLS_KEY_KEY,
    TLS_VOLUME,
    KubeDaskSettings,
    cluster_name,
    dask_labels,
    report_secret_name,
    tls_secret_name,
    worker_group_name,
)
from gpulab.spawner.kube.gpu_resources import PlacedPod
from gpulab.spawner.kube.objects import (
    container_security_context,
    placement_annotation,
    pod_security_context,
)
from gpulab.spawner.names import (
    HOSTNAME_LABEL,
    PLACEMENT_ANNOTATION,
    POD_IP_ENV,
    PRIORITY_LABEL,
    USERNAME_LABEL,
)

SCHEDULER_CONTAINER = "scheduler"
WORKER_CONTAINER = "worker"
#: the module that starts a worker (dask-cuda's where the pod holds a GPU share)
WORKER_MODULE = "gpulab.spawner.singleuser.dask_worker"
#: the pod's own address (names.POD_IP_ENV) in a command: `$(...)` is expanded by Kubernetes from
#: the container's variables
POD_IP = f"$({POD_IP_ENV})"


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


#: a worker's HTTP server serves no route (gpulab reads none of them)
WORKER_ROUTES_ENV = {"name": "DASK_DISTRIBUTED__WORKER__HTTP__ROUTES", "value": "[]"}


def listen_environment() -> list[dict[str, Any]]:
    """What every listener of a cluster's pods binds to: the scheduler's comm and dashboard, a
    worker's nanny and worker comms and its HTTP server.

    Each binds to the pod's address (`POD_IP_ENV`, `--host`, `--dashboard-address`), not to
    every interface (distributed's default for a worker's HTTP server, even with
    `--no-dashboard`). Why another tenant cannot reach them: a pod's address is reached
    only through the cluster's network, where `dask_network_policy` admits the cluster's own
    pods, the owner's pods and the hub alone (another tenant's pod is refused before TLS is
    tried), and the comms require the cluster's certificate besides."""
    return [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


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
            "--host",
            POD_IP,
            "--port",
            str(SCHEDULER_PORT),
            "--dashboard-address",
            f"{POD_IP}:{DASHBOARD_PORT}",
        ],
        "env": [
            {"name": "LANG", "value": "C.UTF-8"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *tls_environment(),
            *listen_environment(),
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
        # the nanny's and the worker's comms, and the worker's HTTP server, whose default
        # (":0") is every interface even with --no-dashboard: the pod's address alone
        "--host",
        POD_IP,
        "--dashboard-address",
        f"{POD_IP}:0",
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
        # an empty value is given as no value, which a container reads as "" all the same
        # (EnvVar's value defaults to ""): the API server refuses `"value": ""` in a
        # DaskWorkerGroup (422 "env.value: Invalid value: null"; a CPU-only worker's
        # CUDA_VISIBLE_DEVICES is one)
        env[key] = {"name": key, "value": value} if value else {"name": key}
    # its comms and HTTP server on the pod's address (listen_environment), the last serving no
    # route
    for entry in [*tls_environment(), *listen_environment(), WORKER_ROUTES_ENV]:
        env[entry["name"]] = dict(entry)
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


__all__ = [
    "dask_cluster_manifest",
    "dask_worker_group_manifest",
    "worker_command",
]
