"""Kubernetes manifests gpulab creates, as pure builders (dicts in, dicts out; no client).

Like KubeSpawner's `objects.py`: every object the Kubernetes backend sends to the API server is
built here, so tests compare whole manifests (tests/spawner/kube/test_objects.py) and the spawner
only decides when to send them.

Object names: label values, DNS names, workspace ids, snapshot names.

Scheduling: gpulab's PriorityClasses, pod affinity that draws related servers together, the
preStop hook that writes the final checkpoint, the Events that say why a pod was stopped.

Tenant isolation of server pods:

- Security contexts: every server runs as a fixed non-root uid/gid (docker-stacks' 1000/100),
  `runAsNonRoot` (the kubelet refuses to start a container that would run as root), no privilege
  escalation (no_new_privs: setuid binaries gain nothing), all capabilities dropped and the
  runtime's default seccomp profile.
- One NetworkPolicy selects every gpulab user server by label (`SERVER_POD_LABEL` beside
  KubeSpawner's app/component, so a stock KubeSpawner hub's pods in the namespace are left
  alone), as z2jh's `singleuser` policy does: the
  rules are the same for every server, so one object (shipped by a chart, or created by the
  spawner) replaces a per-server object that every spawn would create and every crash could leak.
  Ingress only from the hub, the proxy and the metrics scraper (pods labelled
  `hub.jupyter.org/network-access-singleuser: "true"`, or the ipBlocks of a hub outside the
  cluster) on the server's port; egress only to the hub API, DNS and, optionally, the internet
  with private ranges and the cloud metadata address cut out (`ipBlock.except`). Selected pods
  then accept nothing from each other.
- The checkpoint key: a Secret volume, read-only, files 0440 group-owned by fsGroup (the kubelet's
  ownership rule for Secret volumes), so only the pod's own processes read it.

Workspace volumes: the home PVC of a server (with an optional VolumeSnapshot dataSource, which
KubeSpawner's make_pvc lacks), VolumeSnapshots of it, the checkpoint key Secret.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from gpulab.hub.allocator import GpuShare, Placement
from gpulab.hub.allocator.store import request_from_dict, request_to_dict
from gpulab.spawner.names import (
    AFFINITY_LABEL,
    PLACEMENT_ANNOTATION,
    RACK_LABEL,
    WARM_MEMBER_LABEL,
    ZONE_LABEL,
)

SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
SNAPSHOT_VERSION = "v1"
#: the field of the checkpoint key Secret that holds the key (hex)
CHECKPOINT_KEY_FIELD = "key"
MAX_NAME = 253
#: who made the cluster-wide objects gpulab creates (PriorityClasses, the NetworkPolicy)
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpulab"}

#: pod label of the hub, proxy and metrics pods allowed to reach user servers (z2jh's name)
NETWORK_ACCESS_LABEL = "hub.jupyter.org/network-access-singleuser"
#: on every server pod GPUKubeSpawner makes, and in its servers' NetworkPolicy's podSelector: a
#: stock KubeSpawner's pods carry the same app/component labels, and a policy that selected
#: those alone would cut a stock hub's servers in the same namespace off their own hub
SERVER_POD_LABEL = ("gpulab.io/server", "true")
#: the link-local address where clouds serve instance credentials to anything that asks
CLOUD_METADATA_IP = "169.254.169.254"
#: never "the internet": private networks (the cluster's pods and nodes) and loopback (the node's
#: own processes; on the dev cluster, where pods share the host network, the other pods too)
PRIVATE_RANGES = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8")
SECCOMP_TYPES = ("RuntimeDefault", "Unconfined", "Localhost")
#: where the checkpoint key Secret is mounted in the server container, and its file there
CHECKPOINT_KEY_DIR = "/etc/gpulab/checkpoint-key"
CHECKPOINT_KEY_VOLUME = "gpulab-checkpoint-key"
#: the volume of a server's (or a job's) home PVC
HOME_VOLUME = "gpulab-home"


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


def dns_egress() -> dict[str, Any]:
    """An egress rule to the cluster's DNS (any address, port 53)."""
    return {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}


def internet_egress(cloud_metadata_ip: str = CLOUD_METADATA_IP) -> dict[str, Any]:
    """An egress rule to the internet: anything but private ranges (the cluster's pods, the
    hub's machine) and the cloud metadata address (its credentials are the node's)."""
    return {
        "to": [
            {
                "ipBlock": {
                    "cidr": "0.0.0.0/0",
                    "except": [*PRIVATE_RANGES, f"{cloud_metadata_ip}/32"],
                }
            }
        ]
    }


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
        dns_egress(),
    ]
    if allow_internet:
        egress.append(internet_egress(cloud_metadata_ip))
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


def home_volume(claim_name: str) -> dict[str, Any]:
    """The home PVC as a pod volume (a server's pod and its owner's jobs mount the same one)."""
    return {"name": HOME_VOLUME, "persistentVolumeClaim": {"claimName": claim_name}}


def home_mount(home: str) -> dict[str, Any]:
    """The home volume mounted at `home` (GPUKubeSpawner.workspace_home)."""
    return {"name": HOME_VOLUME, "mountPath": home}


# -- the placement annotation: the hub's allocations, kept in the cluster -----------------------


def placement_annotation(placement: Placement) -> str:
    """PLACEMENT_ANNOTATION's value for a pod holding `placement` (servers and job pods alike):
    a restarted hub rebuilds its allocator from these (`placement_from_pod`)."""
    return json.dumps(
        {
            "request": request_to_dict(placement.request),
            "node": placement.node,
            "gpus": [[s.uuid, s.milli] for s in placement.gpus],
            "created_at": placement.created_at,
        },
        sort_keys=True,
    )


def placement_from_pod(pod: dict[str, Any]) -> Placement | None:
    """The placement a pod's PLACEMENT_ANNOTATION holds; None for a pod without one."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(PLACEMENT_ANNOTATION)
    if not raw:
        return None
    data = json.loads(raw)
    return Placement(
        request=request_from_dict(data["request"]),
        node=data["node"],
        gpus=tuple(GpuShare(u, int(m)) for u, m in data["gpus"]),
        created_at=float(data["created_at"]),
    )


# -- object names ----------------------------------------------------------------------------------


def workspace_id(username: str, servername: str) -> str:
    """A label value naming one server's workspace, stable and collision-free (a hash: names
    may be longer than a label allows or escape to the same slug)."""
    digest = hashlib.sha256(f"{username}\0{servername}".encode()).hexdigest()[:20]
    return f"ws-{digest}"


def dns_name(name: str, max_length: int = MAX_NAME) -> str:
    """`name` as a DNS subdomain object name: lowercase [a-z0-9-.], alphanumeric at both ends;
    too long names keep their start plus a hash of the whole."""
    cleaned = re.sub(r"[^a-z0-9.-]+", "-", name.lower()).strip("-.") or "x"
    if len(cleaned) <= max_length:
        return cleaned
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{cleaned[: max_length - 11].rstrip('-.')}-{digest}"


def timestamp_slug(epoch: float) -> str:
    """20261202t180512z: a UTC time usable in object names."""
    return time.strftime("%Y%m%dt%H%M%Sz", time.gmtime(epoch)).lower()


def snapshot_name(pvc_name: str, epoch: float, token: str) -> str:
    """`<pvc>-<timestamp>-<token>`, within the object name limit."""
    suffix = f"-{timestamp_slug(epoch)}-{token}"
    return dns_name(pvc_name, MAX_NAME - len(suffix)) + suffix


# -- scheduling: priority classes, pod affinity, lifecycle, events --------------------------------


def priority_class_manifest(name: str, value: int, priority: str) -> dict[str, Any]:
    """The cluster-wide PriorityClass (scheduling.k8s.io/v1) of one gpulab priority; never the
    cluster's default, so pods that are not gpulab's keep theirs."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name, "labels": dict(MANAGED_BY)},
        "value": int(value),
        "globalDefault": False,
        "description": f"gpulab {priority} servers",
    }


def safe_label_value(value: str) -> str:
    """A Kubernetes label value: 63 characters of [A-Za-z0-9._-], alphanumeric at both ends
    (ASCII: the API server refuses 'å', which str.isalnum accepts)."""
    cleaned = "".join(
        ch if (ch.isascii() and ch.isalnum()) or ch in "._-" else "-" for ch in value
    )[:63]
    return cleaned.strip("._-") or "x"


def related_pod_affinity(group: str) -> list[dict[str, Any]]:
    """Preferred pod affinity that draws related pods into one rack, else one zone."""
    selector = {"matchExpressions": [{"key": AFFINITY_LABEL, "operator": "In", "values": [group]}]}
    return [
        {"weight": 50, "podAffinityTerm": {"labelSelector": selector, "topologyKey": RACK_LABEL}},
        {"weight": 10, "podAffinityTerm": {"labelSelector": selector, "topologyKey": ZONE_LABEL}},
    ]


def prestop_lifecycle(command: Iterable[str], timeout_seconds: int) -> dict[str, Any]:
    """Lifecycle hooks of a server container: `command --timeout <s>` before the pod stops (the
    kernels write their final checkpoint); none for an empty command."""
    command = list(command)
    if not command:
        return {}
    return {"preStop": {"exec": {"command": [*command, "--timeout", str(timeout_seconds)]}}}


def pod_event_manifest(
    pod: Mapping[str, Any], reason: str, message: str, when: str
) -> dict[str, Any]:
    """A Warning Event (core/v1) on `pod` from component gpulab (`when`: RFC 3339 UTC), so that
    `kubectl describe pod` says why gpulab stopped it."""
    meta = pod["metadata"]
    involved: dict[str, Any] = {"kind": "Pod", "name": meta["name"], "namespace": meta["namespace"]}
    if meta.get("uid") is not None:
        involved["uid"] = meta["uid"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": {"component": "gpulab"},
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }


# -- workspace volumes: home PVCs, their VolumeSnapshots, the checkpoint key ------------------------


def volume_snapshot_manifest(
    name: str,
    pvc_name: str,
    *,
    snapshot_class: str = "",
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A snapshot.storage.k8s.io/v1 VolumeSnapshot of claim `pvc_name` (same namespace); an
    empty class means the cluster's default VolumeSnapshotClass for the claim's driver."""
    spec: dict[str, Any] = {"source": {"persistentVolumeClaimName": pvc_name}}
    if snapshot_class:
        spec["volumeSnapshotClassName"] = snapshot_class
    return {
        "apiVersion": f"{SNAPSHOT_GROUP}/{SNAPSHOT_VERSION}",
        "kind": "VolumeSnapshot",
        "metadata": {
            "name": name,
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
    }


def checkpoint_key_secret_manifest(
    name: str, key_hex: str, *, labels: Mapping[str, str], annotations: Mapping[str, str]
) -> dict[str, Any]:
    """The Secret that carries a user's checkpoint signing key into their pods (`secretKeyRef`),
    so that the key is not readable by anyone who may read pod specs."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "labels": dict(labels), "annotations": dict(annotations)},
        "data": {CHECKPOINT_KEY_FIELD: base64.b64encode(key_hex.encode()).decode()},
    }


def home_pvc_manifest(
    name: str,
    *,
    storage: str,
    storage_class: str | None = None,
    access_modes: Iterable[str] = ("ReadWriteOnce",),
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    selector: Mapping[str, Any] | None = None,
    from_snapshot: str | None = None,
) -> dict[str, Any]:
    """A PersistentVolumeClaim for a server's home, like KubeSpawner's make_pvc (same fields:
    storage class, access modes, selector, size), plus an optional VolumeSnapshot to start from
    (`spec.dataSource`; the snapshot must be in the claim's namespace and ready to use)."""
    spec: dict[str, Any] = {
        "accessModes": list(access_modes),
        "resources": {"requests": {"storage": storage}},
    }
    ann = dict(annotations or {})
    if storage_class is not None:
        spec["storageClassName"] = storage_class
        ann["volume.beta.kubernetes.io/storage-class"] = storage_class
    if selector:
        spec["selector"] = dict(selector)
    if from_snapshot:
        spec["dataSource"] = {
            "apiGroup": SNAPSHOT_GROUP,
            "kind": "VolumeSnapshot",
            "name": from_snapshot,
        }
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": dict(labels or {}), "annotations": ann},
        "spec": spec,
    }


# -- warm pool members (gpulab.spawner.kube.warm_pool) ---------------------------------------------

#: the image a warm pool member's main container runs: Kubernetes' pause image (sleeps until
#: stopped, runs as 65535, needs no shell or Python)
PAUSE_IMAGE = "registry.k8s.io/pause:3.9"
#: the uid/gid a member's containers run as (the pause image's own user since 3.8)
WARM_MEMBER_UID = 65535


def warm_member_pod_manifest(
    name: str,
    *,
    namespace: str,
    placement: Placement,
    limits: Mapping[str, str],
    node_affinity_required: Iterable[Mapping[str, Any]],
    tolerations: Iterable[Mapping[str, Any]],
    priority_class_name: str,
    image: str,
    pause_image: str = PAUSE_IMAGE,
    image_pull_policy: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The placeholder pod of one warm pool member: it holds `placement` (the member's
    reservation, in PLACEMENT_ANNOTATION as a server pod holds hers) on the node and devices a
    server of its profile would get (`limits`, the required node affinity that pins it to the
    allocator's node, `tolerations` and the priority class, all from `gpu_resources.placed_pod`).

    Its init container is the profile's server `image` running `true`: on a real cluster the
    kubelet pulls the image onto the node before the member counts as Running, so the user's pod
    that replaces it starts without a pull. The main container is the pause image holding the
    devices (the device plugin allocated them, which proves the node and its plugin ready).
    Nothing of any tenant: no volumes, no service account token, no environment; non-root,
    no privilege escalation, no capabilities, the runtime's seccomp profile."""
    hardening = {
        "runAsUser": WARM_MEMBER_UID,
        "runAsGroup": WARM_MEMBER_UID,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pull = {"imagePullPolicy": image_pull_policy} if image_pull_policy else {}
    affinity = list(node_affinity_required)
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 1,
        "securityContext": {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [
            {
                "name": "pull",
                "image": image,
                "command": ["true"],
                "securityContext": dict(hardening),
                **pull,
            }
        ],
        "containers": [
            {
                "name": "hold",
                "image": pause_image,
                "resources": {"limits": dict(limits), "requests": dict(limits)},
                "securityContext": dict(hardening),
            }
        ],
        "tolerations": [dict(t) for t in tolerations],
    }
    if affinity:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [dict(t) for t in affinity]
                }
            }
        }
    if priority_class_name:
        spec["priorityClassName"] = priority_class_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**(labels or {}), WARM_MEMBER_LABEL: "true"},
            "annotations": {PLACEMENT_ANNOTATION: placement_annotation(placement)},
        },
        "spec": spec,
    }
