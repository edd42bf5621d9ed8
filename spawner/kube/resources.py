"""From a gpulab profile to Kubernetes resources, affinity and tolerations (pure: no client).

Whole GPUs are `nvidia.com/gpu: N` with node affinity on the GPU model label. A fraction of a GPU
is expressed by the cluster's sharing backend, each with its own isolation:
- MIG: a hardware slice (`nvidia.com/mig-<g>g.<mem>gb`), the smallest profile that fits;
- HAMi: `nvidia.com/gpu: 1` plus `nvidia.com/gpumem` (MiB) and `nvidia.com/gpucores` (%);
- time-slicing: `nvidia.com/gpu.shared: 1` (NVIDIA device plugin's shared replicas).

Workspaces: the home PVC of a server (with an optional VolumeSnapshot dataSource, which
KubeSpawner's make_pvc lacks), VolumeSnapshots of it, their listing and retention.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpulab.hub.allocator import GPU, Inventory, Node
from gpulab.spawner.singleuser.checkpoint.store import human_bytes

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
HAMI_MEMORY_RESOURCE = "nvidia.com/gpumem"
HAMI_CORES_RESOURCE = "nvidia.com/gpucores"
PRODUCT_LABEL = "nvidia.com/gpu.product"
ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "gpulab.io/rack"
HOSTNAME_LABEL = "kubernetes.io/hostname"
SPOT_TAINT_KEY = "gpulab.io/spot"
AFFINITY_LABEL = "gpulab.io/affinity-group"

MIG, HAMI, TIME_SLICING = "mig", "hami", "time-slicing"
SHARING_BACKENDS = (MIG, HAMI, TIME_SLICING)

ISOLATION = {
    "whole": "Exclusive: whole GPUs, yours alone while the server runs.",
    MIG: "MIG slice: hardware-isolated memory, compute and fault domain on a shared GPU.",
    HAMI: "HAMi: memory and compute limits enforced by HAMi's CUDA interposer; other users of the GPU share its fault domain.",
    TIME_SLICING: "Time-sliced GPU: turns on a shared GPU with no memory or fault isolation.",
    "cpu": "No GPU.",
}

#: MIG profiles per GPU memory size: (compute slices out of 7, memory GB), smallest first
MIG_PROFILES_BY_MEMORY_GB: dict[int, list[tuple[int, int]]] = {
    40: [(1, 5), (2, 10), (3, 20), (4, 20), (7, 40)],
    80: [(1, 10), (2, 20), (3, 40), (4, 40), (7, 80)],
    94: [(1, 12), (2, 24), (3, 47), (4, 47), (7, 94)],
    141: [(1, 18), (2, 35), (3, 71), (4, 71), (7, 141)],
    24: [(1, 6), (2, 12), (4, 24)],  # A30
}


class KubeProfileError(ValueError):
    """A profile cannot be expressed with the configured sharing backend."""


def product_label(model: str) -> str:
    """gpulab model name -> the NVIDIA GPU feature discovery label value."""
    return model if model.startswith("NVIDIA-") else f"NVIDIA-{model}"


def model_from_product(label: str) -> str:
    return label[len("NVIDIA-") :] if label.startswith("NVIDIA-") else label


def mig_profile_for(memory_mib: int, milli: int) -> str:
    """The smallest MIG profile with at least `milli`/1000 of the GPU's memory and compute."""
    gb = round(memory_mib / 1024)
    table = MIG_PROFILES_BY_MEMORY_GB.get(gb)
    if table is None:
        nearest = min(MIG_PROFILES_BY_MEMORY_GB, key=lambda k: abs(k - gb))
        table = MIG_PROFILES_BY_MEMORY_GB[nearest]
        gb = nearest
    need_mem = gb * milli / 1000
    need_slices = math.ceil(7 * milli / 1000 - 1e-9)
    for slices, mem in table:
        if mem >= need_mem - 1e-9 and slices >= need_slices:
            return f"{slices}g.{mem}gb"
    raise KubeProfileError(f"no MIG profile holds {milli / 1000:.3f} of a {gb} GB GPU")


@dataclass(frozen=True)
class KubeGPUSpec:
    """What a pod needs for a profile: resource limits, scheduling constraints, isolation."""

    limits: dict[str, str] = field(default_factory=dict)
    node_affinity_required: list[dict[str, Any]] = field(default_factory=list)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    priority_class_name: str = ""
    isolation: str = ""


def gpu_spec(
    *,
    num_gpu: int,
    gpu_milli: int,
    gpu_models: Iterable[str],
    gpu_memory_mib: int,
    sharing: str,
    priority: str,
    node_name: str | None = None,
    priority_classes: Mapping[str, str] | None = None,
) -> KubeGPUSpec:
    """Resource limits and constraints for one server.

    `gpu_memory_mib` is the memory of the GPU model the share is carved from (for MIG and HAMi);
    `node_name`, when the allocator chose a node, pins the pod there so the cluster and gpulab's
    accounting agree on where the share lives.
    """
    if sharing not in SHARING_BACKENDS:
        raise KubeProfileError(
            f"gpu_sharing must be one of {list(SHARING_BACKENDS)}, not {sharing!r}"
        )
    priority_classes = priority_classes or {
        "on-demand": "gpulab-on-demand",
        "preemptible": "gpulab-preemptible",
    }
    limits: dict[str, str] = {}
    if num_gpu:
        limits[GPU_RESOURCE] = str(num_gpu)
        isolation = ISOLATION["whole"]
    elif gpu_milli:
        if sharing == MIG:
            limits[f"nvidia.com/mig-{mig_profile_for(gpu_memory_mib, gpu_milli)}"] = "1"
        elif sharing == HAMI:
            limits[GPU_RESOURCE] = "1"
            limits[HAMI_MEMORY_RESOURCE] = str(gpu_memory_mib * gpu_milli // 1000)
            limits[HAMI_CORES_RESOURCE] = str(max(1, math.ceil(gpu_milli / 10)))
        else:
            limits[SHARED_GPU_RESOURCE] = "1"
        isolation = ISOLATION[sharing]
    else:
        isolation = ISOLATION["cpu"]

    terms: list[dict[str, Any]] = []
    models = sorted(gpu_models)
    if models and (num_gpu or gpu_milli):
        terms.append(
            {"key": PRODUCT_LABEL, "operator": "In", "values": [product_label(m) for m in models]}
        )
    if node_name:
        terms.append({"key": HOSTNAME_LABEL, "operator": "In", "values": [node_name]})
    affinity = [{"matchExpressions": terms}] if terms else []

    tolerations = []
    if priority == "preemptible":
        tolerations.append({"key": SPOT_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"})
    return KubeGPUSpec(
        limits=limits,
        node_affinity_required=affinity,
        tolerations=tolerations,
        priority_class_name=priority_classes.get(priority, ""),
        isolation=isolation,
    )


def safe_label_value(value: str) -> str:
    """A Kubernetes label value: 63 characters of [A-Za-z0-9._-], alphanumeric at both ends."""
    cleaned = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in value)[:63]
    return cleaned.strip("._-") or "x"


def related_pod_affinity(group: str) -> list[dict[str, Any]]:
    """Preferred pod affinity that draws related pods into one rack, else one zone."""
    selector = {"matchExpressions": [{"key": AFFINITY_LABEL, "operator": "In", "values": [group]}]}
    return [
        {"weight": 50, "podAffinityTerm": {"labelSelector": selector, "topologyKey": RACK_LABEL}},
        {"weight": 10, "podAffinityTerm": {"labelSelector": selector, "topologyKey": ZONE_LABEL}},
    ]


def _quantity_int(value: Any) -> int:
    text = str(value)
    if text.endswith("k"):
        return int(text[:-1]) * 1000
    return int(text)


def _cpu_milli(value: Any) -> int:
    text = str(value)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


_MEM_SUFFIX = {
    "Ki": 1 / 1024,
    "Mi": 1,
    "Gi": 1024,
    "Ti": 1024**2,
    "K": 1000 / 1024**2,
    "M": 1000**2 / 1024**2,
    "G": 1000**3 / 1024**2,
}


def _memory_mib(value: Any) -> int:
    text = str(value)
    for suffix, factor in sorted(_MEM_SUFFIX.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(int(text) / 1024**2)


def node_is_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def node_from_k8s(node: Mapping[str, Any]) -> Node:
    """A Kubernetes Node object (as a dict) -> an allocator Node with one GPU per `nvidia.com/gpu`.

    Kubernetes does not name individual GPUs (the device plugin picks them), so GPU identities are
    the node name and an index; gpulab accounts shares per GPU, the scheduler binds the pod."""
    meta, status = node["metadata"], node.get("status") or {}
    labels = dict(meta.get("labels") or {})
    alloc = status.get("allocatable") or status.get("capacity") or {}
    count = _quantity_int(alloc.get(GPU_RESOURCE, 0))
    model = model_from_product(labels.get(PRODUCT_LABEL, "unknown-gpu"))
    total_mem = _quantity_int(alloc[HAMI_MEMORY_RESOURCE]) if HAMI_MEMORY_RESOURCE in alloc else 0
    per_gpu_mem = total_mem // count if count and total_mem else 0
    name = meta["name"]
    gpus = tuple(
        GPU(
            uuid=f"{name}/gpu-{i}",
            model=model,
            memory_mib=per_gpu_mem,
            index=i,
            mig_capable=any(k.startswith("nvidia.com/mig-") for k in alloc),
            nvlink_group=labels.get("gpulab.io/nvlink-group")
            or (f"{name}/nvlink" if "SXM" in model else None),
        )
        for i in range(count)
    )
    return Node(
        name=name,
        cpu_milli=_cpu_milli(alloc.get("cpu", "0")),
        memory_mib=_memory_mib(alloc.get("memory", "0")),
        gpus=gpus,
        labels=labels,
    )


def node_is_tainted(node: Mapping[str, Any]) -> bool:
    """Tainted against new pods (NoSchedule/NoExecute): a spot pool, a drained or failing node."""
    return any(
        t.get("effect") in ("NoSchedule", "NoExecute")
        for t in (node.get("spec") or {}).get("taints") or []
    )


def inventory_from_nodes(nodes: Iterable[Mapping[str, Any]]) -> Inventory:
    """Ready, schedulable, untainted nodes -> allocator inventory.

    gpulab pins each pod to the node its allocator chose, so a tainted node (e.g. a spot pool that
    only tolerating pods may use) is left out rather than offered to requests that cannot go
    there."""
    usable = [
        node_from_k8s(n)
        for n in nodes
        if node_is_ready(n)
        and not (n.get("spec") or {}).get("unschedulable")
        and not node_is_tainted(n)
    ]
    return Inventory(sorted(usable, key=lambda n: n.name))


# -- workspace volumes: home PVCs and their VolumeSnapshots --------------------------------------

SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
SNAPSHOT_VERSION = "v1"
WORKSPACE_LABEL = "gpulab.io/workspace"
SNAPSHOT_KIND_LABEL = "gpulab.io/snapshot-label"
#: the field of the checkpoint key Secret that holds the key (hex)
CHECKPOINT_KEY_FIELD = "key"
SNAPSHOT_FILES_ANNOTATION = "snapshot.gpulab.io/files"
MAX_NAME = 253


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


_QUANTITY_FACTORS = {
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "P": 1000**5,
    "E": 1000**6,
}


def quantity_bytes(value: Any) -> int | None:
    """A Kubernetes quantity ('1Gi', '12345', 5e3) in bytes; None when absent or malformed."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    for suffix in sorted(_QUANTITY_FACTORS, key=len, reverse=True):
        if text.endswith(suffix):
            number, factor = text[: -len(suffix)], _QUANTITY_FACTORS[suffix]
            break
    else:
        number, factor = text, 1
    try:
        return int(float(number) * factor)
    except ValueError:
        return None


def parse_time(value: Any) -> float | None:
    """RFC 3339 ('2026-12-02T18:05:12Z', fractions and offsets too) -> epoch seconds."""
    if not value:
        return None
    text = str(value).replace("Z", "+00:00")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def snapshot_listing(vs: Mapping[str, Any]) -> dict[str, Any]:
    """A VolumeSnapshot as the hub lists workspace snapshots: id (its name), label (why it was
    taken), created (epoch seconds), files and bytes (None where the driver does not say), size,
    ready, pvc."""
    meta, status = vs.get("metadata") or {}, vs.get("status") or {}
    created = parse_time(status.get("creationTime")) or parse_time(meta.get("creationTimestamp"))
    files = (meta.get("annotations") or {}).get(SNAPSHOT_FILES_ANNOTATION)
    size = quantity_bytes(status.get("restoreSize"))
    return {
        "id": meta.get("name", ""),
        "label": (meta.get("labels") or {}).get(SNAPSHOT_KIND_LABEL, ""),
        "created": created or 0.0,
        "files": int(files) if files and str(files).isdigit() else None,
        "bytes": size,
        "size": human_bytes(size) if size is not None else "",
        "ready": bool(status.get("readyToUse")),
        "error": (status.get("error") or {}).get("message"),
        "pvc": ((vs.get("spec") or {}).get("source") or {}).get("persistentVolumeClaimName"),
    }


def snapshots_to_delete(
    listings: Iterable[Mapping[str, Any]],
    *,
    keep_last: int,
    keep_daily: int,
    now: float | None = None,
) -> list[str]:
    """Retention like the local backend's: keep the newest `keep_last` snapshots plus the newest
    of each of the last `keep_daily` UTC days (today included); the ids of the rest."""
    if keep_last < 0 or keep_daily < 0:
        raise ValueError(f"keep_last={keep_last} and keep_daily={keep_daily} must be >= 0")
    snaps = sorted(listings, key=lambda s: (float(s["created"]), str(s["id"])))
    keep = {str(s["id"]) for s in snaps[max(0, len(snaps) - keep_last) :]} if keep_last else set()
    today = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).date()
    newest_per_day: dict[Any, Mapping[str, Any]] = {}
    for s in snaps:
        newest_per_day[datetime.fromtimestamp(float(s["created"]), timezone.utc).date()] = s
    for day, s in newest_per_day.items():
        if 0 <= (today - day).days < keep_daily:
            keep.add(str(s["id"]))
    return [str(s["id"]) for s in snaps if str(s["id"]) not in keep]
