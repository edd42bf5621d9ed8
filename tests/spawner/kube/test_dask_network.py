"""The NetworkPolicies of a gpulab Dask cluster on Kubernetes, compared whole (builders in
gpulab.spawner.kube.dask_network): who may connect to a cluster's pods (its own pods, its
owner's and the hub), and what they may reach.
"""

from __future__ import annotations

import dataclasses

from gpulab.spawner.kube.dask_network import dask_client_network_policy, dask_network_policy
from tests.harness.dask_objects import SETTINGS


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
