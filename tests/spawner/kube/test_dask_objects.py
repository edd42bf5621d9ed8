"""The Kubernetes manifests of a gpulab Dask cluster, compared whole (builders in
gpulab.spawner.kube.dask_objects): the DaskCluster, a worker's DaskWorkerGroup for each sharing
backend, the TLS Secret, the NetworkPolicies, names that fit the operator's limits, and what they
must never carry."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from fractions import Fraction
from typing import Any

import pytest

from gpulab.hub.allocator import GPU, GpuShare, Placement, Request
from gpulab.hub.dask.model import scheduler_request
from gpulab.hub.profiles import Profile
from gpulab.spawner.kube.dask_objects import (
    KubeDaskSettings,
    cluster_name,
    dask_client_network_policy,
    dask_cluster_manifest,
    dask_network_policy,
    dask_worker_group_manifest,
    report_owner_patch,
    report_secret_manifest,
    tls_secret_manifest,
    worker_command,
    worker_group_name,
)
from gpulab.spawner.kube.gpu_resources import HAMI, ISOLATION, MIG, TIME_SLICING, placed_pod
from gpulab.spawner.kube.objects import placement_from_pod

A100 = "A100-SXM4-80GB"
CREATED = 1767225600.0
SETTINGS = KubeDaskSettings(
    namespace="gpulab-alice",
    image="quay.io/jupyter/pytorch-notebook:cuda12-2025-12-01",
    python="/opt/conda/bin/python",
    hub_cidrs=("10.0.0.5/32",),
)
QUARTER = Profile(
    "a100-quarter", "1/4 A100", Fraction(1, 4), frozenset({A100}), cpu_limit=2, mem_limit_mib=8192
)
CPU_ONLY = Profile("cpu", "CPU", Fraction(0), cpu_limit=1)
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n"
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
LABELS = {
    "component": "gpulab-dask",
    "hub.jupyter.org/username": "alice",
    "gpulab.io/dask-cluster": "7",
}


def worker_placement(gpus: tuple[GpuShare, ...], node: str = "gpu-node-1") -> Placement:
    request = Request(
        id="alice/dask-7-w3",
        owner="alice",
        cpu_milli=2000,
        memory_mib=8192,
        gpu_milli=QUARTER.gpu_milli,
        gpu_models=QUARTER.gpu_models,
    )
    return Placement(request=request, node=node, gpus=gpus, created_at=CREATED)


def worker_group(
    sharing: str, device: GPU, share: GpuShare, report_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    placement = worker_placement((share,))
    pod = placed_pod(
        QUARTER,
        placement,
        sharing=sharing,
        priority="on-demand",
        device=device,
        gpu_memory_mib=device.memory_mib,  # as GPUKubeSpawner._gpu_memory_mib: the device's
    )
    return dask_worker_group_manifest(
        "alice",
        7,
        3,
        placement=placement,
        pod=pod,
        scheduler_address="tls://10.96.0.20:8786",
        cpu_milli=2000,
        memory_mib=8192,
        environment={"OMP_NUM_THREADS": "2"},
        settings=SETTINGS,
        report_keys=report_keys,
    )


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
                                "--port",
                                "8786",
                                "--dashboard-address",
                                ":8787",
                            ],
                            "env": [
                                {"name": "LANG", "value": "C.UTF-8"},
                                {"name": "PYTHONUNBUFFERED", "value": "1"},
                                *TLS_ENV,
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
                                "--no-dashboard",
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
    assert container["command"][-3:] == ["--memory-limit", "auto", "--no-dashboard"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
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
        "--no-dashboard",
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


def test_the_tls_secret_holds_the_clusters_certificate_and_key_for_its_pods_only() -> None:
    secret = tls_secret_manifest("alice", 7, CERT, KEY, SETTINGS)
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "immutable": True,
        "metadata": {
            "name": "gpulab-dask-alice-7-tls",
            "namespace": "gpulab-alice",
            "labels": LABELS,
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "data": {
            "tls.crt": base64.b64encode(CERT.encode()).decode(),
            "tls.key": base64.b64encode(KEY.encode()).decode(),
        },
    }


def test_a_pod_spec_never_carries_the_key_or_a_service_account_token() -> None:
    body = worker_group(
        MIG, GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"), GpuShare("MIG-2g-0", 250)
    )
    text = json.dumps(body)
    assert "PRIVATE KEY" not in text and "MIGH" not in text
    spec = body["spec"]["worker"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False


def test_only_the_clusters_pods_the_owners_pods_and_the_hub_may_connect() -> None:
    policy = dask_network_policy("alice", 7, SETTINGS)
    members = {"podSelector": {"matchLabels": {"dask.org/cluster-name": "gpulab-dask-alice-7"}}}
    assert policy == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "gpulab-dask-alice-7-ingress",
            "namespace": "gpulab-alice",
            "labels": {
                "app.kubernetes.io/managed-by": "gpulab",
                "component": "gpulab-dask-network-policy",
            },
        },
        "spec": {
            "podSelector": {"matchLabels": {"dask.org/cluster-name": "gpulab-dask-alice-7"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        members,
                        {"podSelector": {"matchLabels": {"hub.jupyter.org/username": "alice"}}},
                        {"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}},
                        {"ipBlock": {"cidr": "10.0.0.5/32"}},
                    ]
                }
            ],
            "egress": [
                {"to": [members]},
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                {
                    "to": [
                        {
                            "ipBlock": {
                                "cidr": "0.0.0.0/0",
                                "except": [
                                    "10.0.0.0/8",
                                    "172.16.0.0/12",
                                    "192.168.0.0/16",
                                    "127.0.0.0/8",
                                    "169.254.169.254/32",
                                ],
                            }
                        }
                    ]
                },
            ],
        },
    }
    # another owner's cluster admits her pods, not alice's
    bob = dask_network_policy("bob", 8, SETTINGS)
    assert {"podSelector": {"matchLabels": {"hub.jupyter.org/username": "bob"}}} in bob["spec"][
        "ingress"
    ][0]["from"]
    assert {"podSelector": {"matchLabels": {"hub.jupyter.org/username": "alice"}}} not in bob[
        "spec"
    ]["ingress"][0]["from"]


def test_the_owners_pods_may_reach_her_cluster_and_only_hers() -> None:
    assert dask_client_network_policy("alice", 7, SETTINGS) == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "gpulab-dask-alice-7-clients",
            "namespace": "gpulab-alice",
            "labels": {
                "app.kubernetes.io/managed-by": "gpulab",
                "component": "gpulab-dask-network-policy",
            },
        },
        "spec": {
            "podSelector": {"matchLabels": {"hub.jupyter.org/username": "alice"}},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [
                        {
                            "podSelector": {
                                "matchLabels": {"dask.org/cluster-name": "gpulab-dask-alice-7"}
                            }
                        }
                    ]
                }
            ],
        },
    }


REPORT = {
    "GPULAB_REPORT_URL": "http://hub.gpulab.svc:8002/api/push",
    "GPULAB_REPORT_TOKEN": "a1b2c3d4e5f60718293a4b5c6d7e8f90",
    "GPULAB_REPORT_NAME": "dask-7-w3",
    "GPULAB_REPORT_USER": "alice",
    "GPULAB_PUSH_INTERVAL_SECONDS": "15",
}


def test_a_workers_report_comes_from_its_secret_by_reference_and_no_token_is_in_the_pod() -> None:
    body = worker_group(
        MIG,
        GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"),
        GpuShare("MIG-2g-0", 250),
        tuple(REPORT),
    )
    assert REPORT["GPULAB_REPORT_TOKEN"] not in json.dumps(body)
    (container,) = body["spec"]["worker"]["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    for key in REPORT:
        assert by_name[key] == {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": "gpulab-dask-alice-7-w3-report", "key": key}},
        }
    # without a report (no gpulab-metrics, or no GPU share) the worker has no report variables
    plain = worker_group(
        MIG, GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"), GpuShare("MIG-2g-0", 250)
    )
    (container,) = plain["spec"]["worker"]["spec"]["containers"]
    assert not [e for e in container["env"] if e["name"].startswith("GPULAB_REPORT_")]
    assert "valueFrom" not in json.dumps(plain)


def test_the_report_secret_holds_the_workers_report_and_is_owned_by_its_group() -> None:
    secret = report_secret_manifest("alice", 7, 3, REPORT, SETTINGS)
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": "gpulab-dask-alice-7-w3-report",
            "namespace": "gpulab-alice",
            "labels": {**LABELS, "gpulab.io/dask-worker": "3"},
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(REPORT.items())},
    }
    group = {"metadata": {"name": "gpulab-dask-alice-7-w3", "uid": "5f1e-77"}}
    assert report_owner_patch(group) == {
        "metadata": {
            "ownerReferences": [
                {
                    "apiVersion": "kubernetes.dask.org/v1",
                    "kind": "DaskWorkerGroup",
                    "name": "gpulab-dask-alice-7-w3",
                    "uid": "5f1e-77",
                }
            ]
        }
    }
    with pytest.raises(ValueError, match="no uid"):
        report_owner_patch({"metadata": {"name": "gpulab-dask-alice-7-w3"}})


def test_with_gpulab_metrics_the_clusters_pods_reach_the_hubs_push_port_and_nothing_else_of_it() -> (
    None
):
    settings = dataclasses.replace(SETTINGS, hub_push_ports=(8002,))
    egress = dask_network_policy("alice", 7, settings)["spec"]["egress"]
    without = dask_network_policy("alice", 7, SETTINGS)["spec"]["egress"]
    added = [rule for rule in egress if rule not in without]
    # as servers' and job pods' push egress: the hub's pods or its addresses, that one port
    assert added == [
        {
            "ports": [{"port": 8002, "protocol": "TCP"}],
            "to": [
                {"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}},
                {"ipBlock": {"cidr": "10.0.0.5/32"}},
            ],
        }
    ]
