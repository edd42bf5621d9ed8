"""Tenant isolation of server pods, as pure manifest builders (no client): security contexts,
the singleuser NetworkPolicy and the checkpoint key as a Secret volume.

- Security contexts: every server runs as a fixed non-root uid/gid (docker-stacks' 1000/100),
  `runAsNonRoot` (the kubelet refuses to start a container that would run as root), no privilege
  escalation (no_new_privs: setuid binaries gain nothing), all capabilities dropped and the
  runtime's default seccomp profile.
- One NetworkPolicy selects every user server by label, as z2jh's `singleuser` policy does: the
  rules are the same for every server, so one object (shipped by a chart, or created by the
  spawner) replaces a per-server object that every spawn would create and every crash could leak.
  Ingress only from the hub, the proxy and the metrics scraper (pods labelled
  `hub.jupyter.org/network-access-singleuser: "true"`, or the ipBlocks of a hub outside the
  cluster) on the server's port; egress only to the hub API, DNS and, optionally, the internet
  with private ranges and the cloud metadata address cut out (`ipBlock.except`). Selected pods
  then accept nothing from each other.
- The checkpoint key: a Secret volume, read-only, files 0440 group-owned by fsGroup (the kubelet's
  ownership rule for Secret volumes), so only the pod's own processes read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: pod label of the hub, proxy and metrics pods allowed to reach user servers (z2jh's name)
NETWORK_ACCESS_LABEL = "hub.jupyter.org/network-access-singleuser"
#: the link-local address where clouds serve instance credentials to anything that asks
CLOUD_METADATA_IP = "169.254.169.254"
#: never "the internet": private networks (the cluster's pods and nodes) and loopback (the node's
#: own processes; on the dev cluster, where pods share the host network, the other pods too)
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8")
SECCOMP_TYPES = ("RuntimeDefault", "Unconfined", "Localhost")
#: where the checkpoint key Secret is mounted in the server container, and its file there
CHECKPOINT_KEY_DIR = "/etc/gpulab/checkpoint-key"
CHECKPOINT_KEY_VOLUME = "gpulab-checkpoint-key"


def seccomp_profile(value: str) -> dict[str, str]:
    """`RuntimeDefault`, `Unconfined` or `Localhost/<path>` as a seccompProfile; ValueError else."""
    kind, _, path = value.partition("/")
    if kind not in SECCOMP_TYPES or (kind == "Localhost") != bool(path):
        raise ValueError(
            f"seccomp profile {value[:80]!r}: use RuntimeDefault, Unconfined or Localhost/<file>"
        )
    return {"type": kind, "localhostProfile": path} if path else {"type": kind}


def pod_security_context(*, run_as_non_root: bool, seccomp: str) -> dict[str, Any]:
    """Pod-level hardening: applies to every container of the pod, init containers an admin adds
    included (KubeSpawner adds fsGroup and supplementalGroups from fs_gid/supplemental_gids)."""
    psc: dict[str, Any] = {"seccompProfile": seccomp_profile(seccomp)}
    if run_as_non_root:
        psc["runAsNonRoot"] = True
    return psc


def container_security_context(
    *, run_as_non_root: bool, seccomp: str, drop_capabilities: Iterable[str]
) -> dict[str, Any]:
    """Container-level hardening for the server container (KubeSpawner adds runAsUser,
    runAsGroup and allowPrivilegeEscalation from uid, gid and allow_privilege_escalation)."""
    csc: dict[str, Any] = {"seccompProfile": seccomp_profile(seccomp)}
    if run_as_non_root:
        csc["runAsNonRoot"] = True
    drop = list(drop_capabilities)
    if drop:
        csc["capabilities"] = {"drop": drop}
    return csc


def _ip_blocks(cidrs: Iterable[str]) -> list[dict[str, Any]]:
    return [{"ipBlock": {"cidr": c}} for c in cidrs]


def singleuser_network_policy(
    name: str,
    *,
    pod_selector: Mapping[str, str],
    server_port: int,
    hub_selector: Mapping[str, str],
    hub_ports: Iterable[int],
    hub_cidrs: Iterable[str] = (),
    allow_internet: bool = True,
    cloud_metadata_ip: str = CLOUD_METADATA_IP,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The NetworkPolicy of all user servers (networking.k8s.io/v1), as a Helm chart renders it.

    `pod_selector`: the labels every server pod carries; `hub_selector`: the hub pod's labels,
    `hub_ports` the ports servers call there (the hub API, the gpulab-metrics service they push
    their GPU figures to); `hub_cidrs`: where a hub and proxy outside the cluster connect from and
    listen (both directions); `allow_internet`: egress to non-private addresses, always except the
    cloud metadata address (its credentials are the node's, never a user's)."""
    cidrs = list(hub_cidrs)
    ingress_from: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": {NETWORK_ACCESS_LABEL: "true"}}},
        *_ip_blocks(cidrs),
    ]
    egress: list[dict[str, Any]] = [
        # server -> hub API (OAuth, activity) and the metrics service (pushes); nothing else of
        # the hub's pod or machine
        {
            "ports": [{"port": port, "protocol": "TCP"} for port in sorted(set(hub_ports))],
            "to": [{"podSelector": {"matchLabels": dict(hub_selector)}}, *_ip_blocks(cidrs)],
        },
        # server -> the cluster's DNS
        {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
    ]
    if allow_internet:
        egress.append(
            {
                "to": [
                    {
                        "ipBlock": {
                            "cidr": "0.0.0.0/0",
                            "except": [*PRIVATE_RANGES, f"{cloud_metadata_ip}/32"],
                        }
                    }
                ]
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "podSelector": {"matchLabels": dict(pod_selector)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"ports": [{"port": server_port, "protocol": "TCP"}], "from": ingress_from}
            ],
            "egress": egress,
        },
    }


def checkpoint_key_volume(secret_name: str, key_field: str, file_name: str) -> dict[str, Any]:
    """The user's key Secret as a volume holding one file, `file_name`. Mode 0440: the kubelet
    makes Secret files group-owned by the pod's fsGroup, so the server's non-root account reads
    it; no other pod mounts this Secret, and nothing of it is in the pod spec or an environment
    (where /proc/<pid>/environ and anyone who may read pods would see it)."""
    return {
        "name": CHECKPOINT_KEY_VOLUME,
        "secret": {
            "secretName": secret_name,
            "items": [{"key": key_field, "path": file_name}],
            "defaultMode": 0o440,
        },
    }


def checkpoint_key_mount() -> dict[str, Any]:
    return {"name": CHECKPOINT_KEY_VOLUME, "mountPath": CHECKPOINT_KEY_DIR, "readOnly": True}
