"""The NetworkPolicies of a gpulab Dask cluster, as pure builders (dicts in, dicts out).

Apart from the pod manifests (`dask_objects`) because they are the cluster's tenant boundary,
read on their own: who may reach its pods and whom they may reach.

`dask_network_policy`: the cluster's pods accept connections only from each other, the owner's
pods (her servers, jobs and other clusters' pods: label `hub.jupyter.org/username`) and the hub,
and reach only each other, DNS and (as servers) the internet without private ranges;
`dask_client_network_policy` lets the owner's pods reach her cluster (the servers' own policy
allows no private address). Another tenant's pod is refused by the scheduler's ingress rules
before TLS is even tried. Where the hub runs gpulab-metrics, the cluster's pods also reach the
hub (its pods or `hub_cidrs`) on the metrics service's push port, and on no other port of it:
workers push their GPU figures there.
"""

from __future__ import annotations

from typing import Any

from gpulab.spawner.kube.dask_settings import (
    OPERATOR_CLUSTER_LABEL,
    KubeDaskSettings,
    client_network_policy_name,
    cluster_name,
    network_policy_name,
)
from gpulab.spawner.kube.objects import MANAGED_BY, dns_egress, internet_egress, safe_label_value
from gpulab.spawner.names import USERNAME_LABEL


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


__all__ = ["dask_client_network_policy", "dask_network_policy"]
