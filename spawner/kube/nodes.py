"""Kubernetes Node objects -> the allocator's inventory (pure: Nodes as dicts, no client)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpulab.hub.allocator import GPU, Inventory, Node
from gpulab.spawner.kube.gpu_resources import model_from_product
from gpulab.spawner.kube.quantities import cpu_milli, memory_mib, quantity_int
from gpulab.spawner.names import (
    GPU_RESOURCE,
    HAMI_MEMORY_RESOURCE,
    MIG_RESOURCE_PREFIX,
    NVLINK_GROUP_LABEL,
    PRODUCT_LABEL,
)


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
    count = quantity_int(alloc.get(GPU_RESOURCE, 0))
    model = model_from_product(labels.get(PRODUCT_LABEL, "unknown-gpu"))
    total_mem = quantity_int(alloc[HAMI_MEMORY_RESOURCE]) if HAMI_MEMORY_RESOURCE in alloc else 0
    per_gpu_mem = total_mem // count if count and total_mem else 0
    name = meta["name"]
    gpus = tuple(
        GPU(
            uuid=f"{name}/gpu-{i}",
            model=model,
            memory_mib=per_gpu_mem,
            index=i,
            mig_capable=any(k.startswith(MIG_RESOURCE_PREFIX) for k in alloc),
            nvlink_group=labels.get(NVLINK_GROUP_LABEL)
            or (f"{name}/nvlink" if "SXM" in model else None),
        )
        for i in range(count)
    )
    return Node(
        name=name,
        cpu_milli=cpu_milli(alloc.get("cpu", "0")),
        memory_mib=memory_mib(alloc.get("memory", "0")),
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
