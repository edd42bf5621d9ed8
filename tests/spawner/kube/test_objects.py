"""The Kubernetes manifests gpulab sends, compared whole (builders in gpulab.spawner.kube.objects).

A whole-dict comparison fails on any field added, dropped or renamed, which a test of one field
would miss; the builders are pure, so no cluster is needed.
"""

from __future__ import annotations

from gpulab.spawner.kube.objects import (
    home_pvc_manifest,
    pod_event_manifest,
    prestop_lifecycle,
    priority_class_manifest,
    related_pod_affinity,
    singleuser_network_policy,
    volume_snapshot_manifest,
)


def test_priority_class_is_labelled_as_gpulabs_and_never_the_cluster_default():
    assert priority_class_manifest("gpulab-preemptible", 100, "preemptible") == {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {
            "name": "gpulab-preemptible",
            "labels": {"app.kubernetes.io/managed-by": "gpulab"},
        },
        "value": 100,
        "globalDefault": False,
        "description": "gpulab preemptible servers",
    }


def test_eviction_event_names_the_pod_and_says_why():
    pod = {"metadata": {"name": "jupyter-ada", "namespace": "lab", "uid": "u-1"}}
    when = "2026-12-03T18:00:00Z"
    assert pod_event_manifest(pod, "Preempted", "for on-demand server bob", when) == {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "jupyter-ada.", "namespace": "lab"},
        "involvedObject": {"kind": "Pod", "name": "jupyter-ada", "namespace": "lab", "uid": "u-1"},
        "reason": "Preempted",
        "message": "for on-demand server bob",
        "type": "Warning",
        "source": {"component": "gpulab"},
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }


def test_eviction_event_of_a_pod_without_uid_leaves_the_uid_out():
    pod = {"metadata": {"name": "p", "namespace": "n"}}
    event = pod_event_manifest(pod, "NodeLost", "gone", "2026-12-03T18:00:00Z")
    assert event["involvedObject"] == {"kind": "Pod", "name": "p", "namespace": "n"}


def test_prestop_hook_runs_the_command_with_its_timeout():
    assert prestop_lifecycle(["python3", "-m", "gpulab.spawner.singleuser.prestop"], 55) == {
        "preStop": {
            "exec": {
                "command": [
                    "python3",
                    "-m",
                    "gpulab.spawner.singleuser.prestop",
                    "--timeout",
                    "55",
                ]
            }
        }
    }


def test_an_empty_prestop_command_means_no_hooks():
    assert prestop_lifecycle([], 55) == {}


def test_related_pod_affinity_prefers_the_rack_over_the_zone():
    selector = {
        "matchExpressions": [
            {"key": "gpulab.io/affinity-group", "operator": "In", "values": ["ada"]}
        ]
    }
    assert related_pod_affinity("ada") == [
        {
            "weight": 50,
            "podAffinityTerm": {"labelSelector": selector, "topologyKey": "gpulab.io/rack"},
        },
        {
            "weight": 10,
            "podAffinityTerm": {
                "labelSelector": selector,
                "topologyKey": "topology.kubernetes.io/zone",
            },
        },
    ]


def test_plain_home_pvc():
    assert home_pvc_manifest(
        "gpulab-home-ada",
        storage="10Gi",
        storage_class="gpulab-local",
        labels={"gpulab.io/workspace": "ws-1"},
    ) == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "gpulab-home-ada",
            "labels": {"gpulab.io/workspace": "ws-1"},
            "annotations": {"volume.beta.kubernetes.io/storage-class": "gpulab-local"},
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "10Gi"}},
            "storageClassName": "gpulab-local",
        },
    }


def test_volume_snapshot_of_a_home_claim():
    assert volume_snapshot_manifest(
        "gpulab-home-ada-20261203t180000z-abc123",
        "gpulab-home-ada",
        snapshot_class="gpulab-local",
        labels={"gpulab.io/snapshot-label": "stop"},
    ) == {
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshot",
        "metadata": {
            "name": "gpulab-home-ada-20261203t180000z-abc123",
            "labels": {"gpulab.io/snapshot-label": "stop"},
            "annotations": {},
        },
        "spec": {
            "source": {"persistentVolumeClaimName": "gpulab-home-ada"},
            "volumeSnapshotClassName": "gpulab-local",
        },
    }


def test_network_policy_without_internet_admits_the_hub_side_and_reaches_only_hub_and_dns():
    assert singleuser_network_policy(
        "gpulab-singleuser",
        pod_selector={"component": "singleuser-server"},
        server_port=8888,
        hub_selector={"component": "hub"},
        hub_ports=[8081, 9000, 8081],
        hub_cidrs=["10.0.0.5/32"],
        allow_internet=False,
        labels={"app.kubernetes.io/managed-by": "gpulab"},
    ) == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "gpulab-singleuser",
            "labels": {"app.kubernetes.io/managed-by": "gpulab"},
        },
        "spec": {
            "podSelector": {"matchLabels": {"component": "singleuser-server"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "ports": [{"port": 8888, "protocol": "TCP"}],
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": {"hub.jupyter.org/network-access-singleuser": "true"}
                            }
                        },
                        {"ipBlock": {"cidr": "10.0.0.5/32"}},
                    ],
                }
            ],
            "egress": [
                {
                    "ports": [
                        {"port": 8081, "protocol": "TCP"},
                        {"port": 9000, "protocol": "TCP"},
                    ],
                    "to": [
                        {"podSelector": {"matchLabels": {"component": "hub"}}},
                        {"ipBlock": {"cidr": "10.0.0.5/32"}},
                    ],
                },
                {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
            ],
        },
    }
