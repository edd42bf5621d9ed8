"""The Kubernetes manifests of a gpulab Dask cluster's scheduler and workers, compared whole
(builders in gpulab.spawner.kube.dask_objects): the DaskCluster, a worker's DaskWorkerGroup for
each sharing backend, and names that fit the operator's limits. Its Secrets are
test_dask_secrets.py's, its NetworkPolicies test_dask_network.py's."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from gpulab.hub.allocator import GPU, GpuShare, Placement
from gpulab.hub.dask.allocations import scheduler_request
from gpulab.hub.profiles import Profile
from gpulab.spawner.kube.dask_objects import (
    dask_cluster_manifest,
    dask_worker_group_manifest,
    worker_command,
)
from gpulab.spawner.kube.dask_settings import cluster_name, worker_group_name
from gpulab.spawner.kube.gpu_resources import HAMI, ISOLATION, MIG, TIME_SLICING, placed_pod
from gpulab.spawner.kube.objects import placement_from_pod
from tests.harness.dask_objects import (
    A100,
    CREATED,
    LABELS,
    SETTINGS,
    worker_group,
    worker_placement,
)

CPU_ONLY = Profile("cpu", "CPU", Fraction(0), cpu_limit=1)
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
TLS_ENV = [
    {"name": "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION", "value": "True"},
    {"name": "DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME", "value": "tls"},
    {"name": "DASK_DISTRIBUTED__COMM__TLS__CA_FILE", "value": "/etc/gpulab/dask-tls/tls.crt"},
    {
        "name": "DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__CERT",
        "value": "/etc/gpulab/dask-tls/tls.crt",
    },
    {
        "name": "DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__KEY",
        "value": "/etc/gpulab/dask-tls/tls.key",
    },
    {"name": "DASK_DISTRIBUTED__COMM__TLS__WORKER__CERT", "value": "/etc/gpulab/dask-tls/tls.crt"},
    {"name": "DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY", "value": "/etc/gpulab/dask-tls/tls.key"},
    {"name": "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT", "value": "/etc/gpulab/dask-tls/tls.crt"},
    {"name": "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY", "value": "/etc/gpulab/dask-tls/tls.key"},
]
#: every listener of a cluster's pods on the pod's address (Kubernetes expands $(...) from the
#: downward API's variable), never on every interface; the workers' HTTP servers serve no route
LISTEN_ENV = [
    {"name": "GPULAB_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]
WORKER_LISTEN_ARGS = [
    "--host",
    "$(GPULAB_POD_IP)",
    "--dashboard-address",
    "$(GPULAB_POD_IP):0",
    "--no-dashboard",
]
WORKER_ENV = [{"name": "DASK_DISTRIBUTED__WORKER__HTTP__ROUTES", "value": "[]"}]
HARDENED_CONTAINER = {
    "runAsUser": 1000,
    "runAsGroup": 100,
    "allowPrivilegeEscalation": False,
    "seccompProfile": {"type": "RuntimeDefault"},
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
HARDENED_POD = {"fsGroup": 100, "seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True}
TLS_VOLUME = {
    "name": "gpulab-dask-tls",
    "secret": {"secretName": "gpulab-dask-alice-7-tls", "defaultMode": 0o440},
}
TLS_MOUNT = {"name": "gpulab-dask-tls", "mountPath": "/etc/gpulab/dask-tls", "readOnly": True}


def test_the_daskcluster_runs_a_hardened_tls_scheduler_on_its_placement_with_no_workers() -> None:
    placement = Placement(
        request=scheduler_request(
            "alice", frozenset(), 7, cpu_milli=500, memory_mib=1024, affinity_group=None
        ),
        node="cpu-node-2",
        gpus=(),
        created_at=CREATED,
    )
    body = dask_cluster_manifest(
        "alice", 7, placement=placement, settings=SETTINGS, priority_class_name="gpulab-on-demand"
    )
    scheduler = body["spec"]["scheduler"]
    annotation = scheduler["metadata"]["annotations"]["gpulab.io/placement"]
    assert body == {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskCluster",
        "metadata": {
            "name": "gpulab-dask-alice-7",
            "namespace": "gpulab-alice",
            "labels": LABELS,
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "spec": {
            "idleTimeout": 0,
            "scheduler": {
                "metadata": {
                    "labels": {**LABELS, "gpulab.io/priority": "on-demand"},
                    "annotations": {"gpulab.io/placement": annotation},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 20,
                    "securityContext": HARDENED_POD,
                    "containers": [
                        {
                            "name": "scheduler",
                            "image": SETTINGS.image,
                            "command": [
                                "/opt/conda/bin/python",
                                "-m",
                                "distributed.cli.dask_scheduler",
                                "--protocol",
                                "tls",
                                "--host",
                                "$(GPULAB_POD_IP)",
                                "--port",
                                "8786",
                                "--dashboard-address",
                                "$(GPULAB_POD_IP):8787",
                            ],
                            "env": [
                                {"name": "LANG", "value": "C.UTF-8"},
                                {"name": "PYTHONUNBUFFERED", "value": "1"},
                                *TLS_ENV,
                                *LISTEN_ENV,
                            ],
                            "ports": [
                                {"name": "tcp-comm", "containerPort": 8786, "protocol": "TCP"},
                                {
                                    "name": "http-dashboard",
                                    "containerPort": 8787,
                                    "protocol": "TCP",
                                },
                            ],
                            "resources": {
                                "limits": {"cpu": "500m", "memory": "1024Mi"},
                                "requests": {"cpu": "500m", "memory": "1024Mi"},
                            },
                            "readinessProbe": {
                                "tcpSocket": {"port": "http-dashboard"},
                                "periodSeconds": 1,
                                "failureThreshold": 3,
                            },
                            "securityContext": HARDENED_CONTAINER,
                            "volumeMounts": [TLS_MOUNT],
                        }
                    ],
                    "volumes": [TLS_VOLUME],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": ["cpu-node-2"],
                                            }
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                    "priorityClassName": "gpulab-on-demand",
                },
                "service": {
                    "type": "ClusterIP",
                    "selector": {
                        "dask.org/cluster-name": "gpulab-dask-alice-7",
                        "dask.org/component": "scheduler",
                    },
                    "ports": [
                        {
                            "name": "tcp-comm",
                            "protocol": "TCP",
                            "port": 8786,
                            "targetPort": "tcp-comm",
                        },
                        {
                            "name": "http-dashboard",
                            "protocol": "TCP",
                            "port": 8787,
                            "targetPort": "http-dashboard",
                        },
                    ],
                },
            },
            # the operator's default group: never scaled (each worker is a group of its own)
            "worker": {
                "replicas": 0,
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 20,
                    "securityContext": HARDENED_POD,
                    "containers": [
                        {
                            "name": "worker",
                            "image": SETTINGS.image,
                            "command": ["false"],
                            "securityContext": HARDENED_CONTAINER,
                            "volumeMounts": [TLS_MOUNT],
                        }
                    ],
                    "volumes": [TLS_VOLUME],
                },
            },
        },
    }
    # a restarted hub rebuilds the scheduler's allocation from its pod
    restored = placement_from_pod({"metadata": scheduler["metadata"]})
    assert restored == placement


@pytest.mark.parametrize(
    ("sharing", "device", "share", "limits", "share_env"),
    [
        (
            MIG,
            GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"),
            GpuShare("MIG-2g-0", 250),
            {"nvidia.com/mig-2g.20gb": "1"},
            {
                "GPULAB_GPU_MODEL": f"{A100} MIG 2g.20gb",
                "GPULAB_GPU_DEVICE_MEMORY_MIB": "20480",
                "GPULAB_GPU_ENFORCEMENT": "mig",
                "GPULAB_GPU_FRACTION": "0.250",
                "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
            },
        ),
        (
            TIME_SLICING,
            GPU("GPU-ts-0", A100, 81920),
            GpuShare("GPU-ts-0", 250),
            {"nvidia.com/gpu.shared": "1"},
            {
                "GPULAB_GPU_MODEL": A100,
                "GPULAB_GPU_DEVICE_MEMORY_MIB": "81920",
                "GPULAB_GPU_ENFORCEMENT": "time-slicing",
                "GPULAB_GPU_FRACTION": "0.250",
                "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
            },
        ),
        (
            HAMI,
            GPU("GPU-hami-0", A100, 81920),
            GpuShare("GPU-hami-0", 250),
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20480", "nvidia.com/gpucores": "25"},
            {
                "GPULAB_GPU_MODEL": A100,
                "GPULAB_GPU_DEVICE_MEMORY_MIB": "81920",
                "GPULAB_GPU_ENFORCEMENT": "hami",
                "GPULAB_GPU_FRACTION": "0.250",
                "GPULAB_GPU_MEMORY_LIMIT_MIB": "20480",
            },
        ),
    ],
)
def test_a_workers_group_has_one_replica_holding_its_share_in_the_backends_resources(
    sharing: str, device: GPU, share: GpuShare, limits: dict[str, str], share_env: dict[str, str]
) -> None:
    body = worker_group(sharing, device, share)
    worker = body["spec"]["worker"]
    annotation = worker["metadata"]["annotations"]["gpulab.io/placement"]
    resources = {"cpu": "2000m", "memory": "8192Mi", **limits}
    products = ["NVIDIA-A100-SXM4-80GB"]
    if sharing == TIME_SLICING:  # GFD's label of a time-sliced node
        products.append("NVIDIA-A100-SXM4-80GB-SHARED")
    assert body == {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskWorkerGroup",
        "metadata": {
            "name": "gpulab-dask-alice-7-w3",
            "namespace": "gpulab-alice",
            "labels": {**LABELS, "gpulab.io/dask-worker": "3"},
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "spec": {
            "cluster": "gpulab-dask-alice-7",
            "worker": {
                "replicas": 1,
                "metadata": {
                    "labels": {
                        **LABELS,
                        "gpulab.io/dask-worker": "3",
                        "gpulab.io/priority": "on-demand",
                    },
                    "annotations": {
                        "hub.jupyter.org/username": "alice",
                        "gpulab.io/placement": annotation,
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 20,
                    "securityContext": HARDENED_POD,
                    "containers": [
                        {
                            "name": "worker",
                            "image": SETTINGS.image,
                            "command": [
                                "/opt/conda/bin/python",
                                "-m",
                                "gpulab.spawner.singleuser.dask_worker",
                                "--gpu",
                                "--",
                                "tls://10.96.0.20:8786",
                                "--name",
                                "w3",
                                "--nthreads",
                                "2",
                                "--memory-limit",
                                "8192MiB",
                                *WORKER_LISTEN_ARGS,
                            ],
                            "env": [
                                {"name": "LANG", "value": "C.UTF-8"},
                                {"name": "PYTHONUNBUFFERED", "value": "1"},
                                {"name": "OMP_NUM_THREADS", "value": "2"},
                                {"name": "GPULAB_PROFILE", "value": "a100-quarter"},
                                {"name": "GPULAB_ISOLATION", "value": ISOLATION[sharing]},
                                {"name": "GPULAB_GPU_SHARING", "value": sharing},
                                *[{"name": k, "value": v} for k, v in share_env.items()],
                                *TLS_ENV,
                                *LISTEN_ENV,
                                *WORKER_ENV,
                            ],
                            "resources": {"limits": resources, "requests": resources},
                            "securityContext": HARDENED_CONTAINER,
                            "volumeMounts": [TLS_MOUNT],
                        }
                    ],
                    "volumes": [TLS_VOLUME],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "nvidia.com/gpu.product",
                                                "operator": "In",
                                                "values": products,
                                            },
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": ["gpu-node-1"],
                                            },
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                    "priorityClassName": "gpulab-on-demand",
                },
            },
        },
    }
    assert json.loads(annotation)["request"]["id"] == "alice/dask-7-w3"
    assert placement_from_pod({"metadata": worker["metadata"]}) == worker_placement((share,))


def test_a_cpu_only_worker_runs_a_plain_worker_and_sees_no_gpu() -> None:
    placement = worker_placement(())
    pod = placed_pod(
        CPU_ONLY, placement, sharing=MIG, priority="on-demand", device=None, gpu_memory_mib=0
    )
    body = dask_worker_group_manifest(
        "alice",
        7,
        1,
        placement=placement,
        pod=pod,
        scheduler_address="tls://10.96.0.20:8786",
        cpu_milli=1000,
        memory_mib=0,
        settings=SETTINGS,
    )
    (container,) = body["spec"]["worker"]["spec"]["containers"]
    assert "--gpu" not in container["command"]
    assert container["command"][-7:] == ["--memory-limit", "auto", *WORKER_LISTEN_ARGS]
    env = {e["name"]: e for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"
    # no value is "" to the container; the API server refuses `"value": ""` in a DaskWorkerGroup
    assert env["CUDA_VISIBLE_DEVICES"] == {"name": "CUDA_VISIBLE_DEVICES"}
    assert not [e for e in container["env"] if e.get("value") == ""]
    assert container["resources"]["limits"] == {"cpu": "1000m"}


def test_worker_command_names_the_worker_after_its_number() -> None:
    assert worker_command(
        "python3",
        scheduler_address="tls://s:8786",
        number=12,
        holds_gpu=True,
        nthreads=4,
        memory_mib=1024,
    ) == [
        "python3",
        "-m",
        "gpulab.spawner.singleuser.dask_worker",
        "--gpu",
        "--",
        "tls://s:8786",
        "--name",
        "w12",
        "--nthreads",
        "4",
        "--memory-limit",
        "1024MiB",
        *WORKER_LISTEN_ARGS,
    ]


def test_names_fit_the_operators_limits_whatever_the_owner() -> None:
    assert cluster_name("alice", 7) == "gpulab-dask-alice-7"
    long_owner = "a.very.long.user.name@example.university.edu" * 2
    for owner in (long_owner, "Ünïcode Üser", "x"):
        name = cluster_name(owner, 123456)
        group = worker_group_name(name, 999)
        # the operator's Deployment of a worker: "<group>-worker-<10 hex>", a label value
        assert len(f"{group}-worker-0123456789") <= 63
        assert len(f"{name}-scheduler") <= 63
        assert DNS_LABEL.fullmatch(name) and DNS_LABEL.fullmatch(group)
        assert name.endswith("-123456")
    # two owners whose names are cut alike still get two names
    assert cluster_name(long_owner, 1) != cluster_name(long_owner + "x", 1)
