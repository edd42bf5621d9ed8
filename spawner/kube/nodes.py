"""Kubernetes Node objects -> the allocator's inventory (pure: Nodes as dicts, no client).

A node's GPUs become the devices its device plugin hands out, so the allocator places shares
against what pods can actually get (no share is admitted that would leave a pod Pending):

- ``nvidia.com/gpu``: whole GPUs (with MIG's mixed strategy, the GPUs not in MIG mode);
- ``nvidia.com/mig-<profile>``: one device per MIG instance, holding one share of at most its
  profile's part of the GPU;
- ``nvidia.com/gpu.shared``: one device per time-slicing replica, holding one share;
- HAMi (its registration annotation): each GPU takes shares in steps of 1/split, so no more
  than its split count of shares land on it.

Fractions go only to the devices of the configured sharing backend; a GPU offered otherwise
still serves whole-GPU requests (``share_step_milli=0``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpulab.hub.allocator import GPU, MILLI, Inventory, Node
from gpulab.hub.inventory import KNOWN_MODELS, PART_MAX_MILLI, mig_instance_milli
from gpulab.spawner.kube.gpu_resources import HAMI, MIG, TIME_SLICING, model_from_product
from gpulab.spawner.kube.quantities import cpu_milli, memory_mib, quantity_int
from gpulab.spawner.names import (
    GPU_COUNT_LABEL,
    GPU_MEMORY_LABEL,
    GPU_REPLICAS_LABEL,
    GPU_RESOURCE,
    HAMI_REGISTER_ANNOTATION,
    INVENTORY_LABEL,
    MIG_RESOURCE_PREFIX,
    NVLINK_GROUP_LABEL,
    PRODUCT_LABEL,
    SHARED_GPU_RESOURCE,
    SIMULATED_INVENTORY,
    SIMULATED_NODE_ANNOTATION,
)


def node_is_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def hami_devices(annotations: Mapping[str, str]) -> list[tuple[str, int, int]]:
    """(uuid, split count, memory MiB) of each healthy GPU in HAMi's registration annotation."""
    out = []
    for entry in (annotations.get(HAMI_REGISTER_ANNOTATION) or "").split(":"):
        fields = entry.split(",")
        if len(fields) < 7 or fields[6].strip().lower() != "true":
            continue
        try:
            out.append((fields[0], int(fields[1]), int(fields[2])))
        except ValueError:
            continue
    return out


def node_from_k8s(node: Mapping[str, Any], sharing: str = MIG) -> Node:
    """A Kubernetes Node object (as a dict) -> an allocator Node of the devices it offers.

    Kubernetes does not name individual GPUs (the device plugin picks them), so device
    identities are the node name and an index; gpulab accounts shares per device, the scheduler
    binds the pod, and the counts agree."""
    meta, status = node["metadata"], node.get("status") or {}
    labels = dict(meta.get("labels") or {})
    alloc = status.get("allocatable") or status.get("capacity") or {}
    model = model_from_product(labels.get(PRODUCT_LABEL, "unknown-gpu"))
    name = meta["name"]
    gpu_mem = _int(labels.get(GPU_MEMORY_LABEL))
    nvlink = labels.get(NVLINK_GROUP_LABEL) or (f"{name}/nvlink" if "SXM" in model else None)
    mig_capable = any(k.startswith(MIG_RESOURCE_PREFIX) for k in alloc)
    gpus: list[GPU] = []

    def add(uuid: str, **kw: Any) -> None:
        gpus.append(GPU(uuid=uuid, model=model, index=len(gpus), mig_capable=mig_capable, **kw))

    hami = hami_devices(meta.get("annotations") or {})
    if hami:  # HAMi's nvidia.com/gpu counts virtual GPUs; its annotation names the GPUs
        for uuid, split, mem in hami:
            step = MILLI // max(1, split) if sharing == HAMI else 0
            add(uuid, memory_mib=mem, nvlink_group=nvlink, share_step_milli=step)
    else:
        for i in range(quantity_int(alloc.get(GPU_RESOURCE, 0))):
            add(f"{name}/gpu-{i}", memory_mib=gpu_mem, nvlink_group=nvlink, share_step_milli=0)
    if sharing == MIG:
        for key in sorted(alloc):
            if not key.startswith(MIG_RESOURCE_PREFIX):
                continue
            profile = key[len(MIG_RESOURCE_PREFIX) :]
            milli = mig_instance_milli(profile, gpu_mem or _model_memory(model))
            mem = int(profile.split(".")[1].removesuffix("gb")) * 1024
            for k in range(quantity_int(alloc[key])):
                add(
                    f"{name}/mig-{profile}-{k}",
                    memory_mib=mem,
                    capacity_milli=milli,
                    share_step_milli=milli,
                    mig_profile=profile,
                )
    replicas_total = quantity_int(alloc.get(SHARED_GPU_RESOURCE, 0))
    if sharing == TIME_SLICING and replicas_total:
        per_gpu = _int(labels.get(GPU_REPLICAS_LABEL)) or max(
            1, replicas_total // max(1, _int(labels.get(GPU_COUNT_LABEL)))
        )
        milli = min(PART_MAX_MILLI, MILLI // per_gpu)
        for k in range(replicas_total):
            add(
                f"{name}/gpu-{k // per_gpu}/replica-{k % per_gpu}",
                memory_mib=gpu_mem,
                capacity_milli=milli,
                share_step_milli=milli,
            )
    if (meta.get("annotations") or {}).get(SIMULATED_NODE_ANNOTATION) == "true":
        labels[INVENTORY_LABEL] = SIMULATED_INVENTORY  # a dev-cluster node: no GPU to measure
    return Node(
        name=name,
        cpu_milli=cpu_milli(alloc.get("cpu", "0")),
        memory_mib=memory_mib(alloc.get("memory", "0")),
        gpus=tuple(gpus),
        labels=labels,
    )


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def _model_memory(model: str) -> int:
    known = KNOWN_MODELS.get(model)
    return known.memory_mib if known else 81920


def node_is_tainted(node: Mapping[str, Any]) -> bool:
    """Tainted against new pods (NoSchedule/NoExecute): a spot pool, a drained or failing node."""
    return any(
        t.get("effect") in ("NoSchedule", "NoExecute")
        for t in (node.get("spec") or {}).get("taints") or []
    )


def inventory_from_nodes(nodes: Iterable[Mapping[str, Any]], sharing: str = MIG) -> Inventory:
    """Ready, schedulable, untainted nodes -> allocator inventory.

    gpulab pins each pod to the node its allocator chose, so a tainted node (e.g. a spot pool that
    only tolerating pods may use) is left out rather than offered to requests that cannot go
    there."""
    usable = [
        node_from_k8s(n, sharing)
        for n in nodes
        if node_is_ready(n)
        and not (n.get("spec") or {}).get("unschedulable")
        and not node_is_tainted(n)
    ]
    return Inventory(sorted(usable, key=lambda n: n.name))
