"""The pod side of a placement on the hub's inventory: the devices, node pin and scheduling that a
server's pod, a job's, a Dask worker's and a warm pool member's get for the same share.

Apart from the spawner (`gpulab.spawner.kube.spawner`) because the warm pool's members are made
before any spawner exists (`warm_start`): both it and the spawner map a placement through these,
on the hub's `GPUCapacity`, to `gpu_resources.placed_pod`.
"""

from __future__ import annotations

from gpulab.hub.allocator import Placement
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.inventory import KNOWN_MODELS
from gpulab.hub.profiles import Profile
from gpulab.spawner.gpu_mixin import node_inventory
from gpulab.spawner.kube.gpu_resources import PlacedPod, placed_pod


def gpu_memory_mib(capacity: GPUCapacity, placement: Placement) -> int:
    """The memory of the GPU model `placement`'s first share lies on (0 without GPUs);
    ValueError for a model of unknown size."""
    if not placement.gpus:
        return 0
    gpu = capacity.gpu_by_uuid(placement.gpus[0].uuid)
    if gpu.memory_mib:
        return int(gpu.memory_mib)
    known = KNOWN_MODELS.get(gpu.model)
    if known is None:
        raise ValueError(
            f"GPU model {gpu.model!r} of node {placement.node} has no known memory size"
        )
    return known.memory_mib


def placed_pod_on(
    capacity: GPUCapacity,
    profile: Profile,
    placement: Placement,
    *,
    sharing: str,
    priority: str,
    priority_classes: dict[str, str],
) -> PlacedPod:
    """`gpu_resources.placed_pod` for `placement` on the hub's inventory: a server's pod, a
    job's and a warm pool member's get the same devices, node pin and scheduling."""
    device = capacity.gpu_by_uuid(placement.gpus[0].uuid) if placement.gpus else None
    return placed_pod(
        profile,
        placement,
        sharing=sharing,
        priority=priority,
        device=device,
        gpu_memory_mib=gpu_memory_mib(capacity, placement),
        priority_classes=priority_classes,
        inventory=node_inventory(capacity.inventory, placement.node),
    )
