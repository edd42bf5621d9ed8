"""From a gpulab profile to Kubernetes resources, affinity and tolerations (pure: no client).

Whole GPUs are `nvidia.com/gpu: N` with node affinity on the GPU model label. A fraction of a GPU
is expressed by the cluster's sharing backend, each with its own isolation:
- MIG: a hardware slice (`nvidia.com/mig-<g>g.<mem>gb`), the smallest profile that fits;
- HAMi: `nvidia.com/gpu: 1` plus `nvidia.com/gpumem` (MiB) and `nvidia.com/gpucores` (%);
- time-slicing: `nvidia.com/gpu.shared: 1` (NVIDIA device plugin's shared replicas).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpulab.hub.allocator import GPU, Inventory, Node

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
