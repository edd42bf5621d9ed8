"""From a gpulab profile to NVIDIA resource requests, node affinity and tolerations (pure: no client).

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

from gpulab.hub.allocator import GPU, Placement
from gpulab.hub.inventory import MIG_PROFILES_BY_MEMORY_GB
from gpulab.hub.profiles import Profile
from gpulab.spawner.environment import CPU_ONLY, EXCLUSIVE
from gpulab.spawner.names import (
    GPU_DEVICE_MEMORY_MIB_ENV,
    GPU_ENFORCEMENT_ENV,
    GPU_FRACTION_ENV,
    GPU_INVENTORY_ENV,
    GPU_MEMORY_LIMIT_MIB_ENV,
    GPU_MODEL_ENV,
    GPU_RESOURCE,
    GPU_SHARING_ENV,
    HAMI_CORES_RESOURCE,
    HAMI_MEMORY_RESOURCE,
    HOSTNAME_LABEL,
    ISOLATION_ENV,
    MIG_RESOURCE_PREFIX,
    PRODUCT_LABEL,
    PROFILE_ENV,
    SHARED_GPU_RESOURCE,
    SHARED_PRODUCT_SUFFIX,
    SPOT_TAINT_KEY,
)

MIG, HAMI, TIME_SLICING = "mig", "hami", "time-slicing"
SHARING_BACKENDS = (MIG, HAMI, TIME_SLICING)

#: The variable by which NVIDIA's container runtime decides which GPUs a container gets
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
#: NVIDIA's container toolkit: `void` (or empty, or unset) gives a container no GPU and no driver
#: (as runc would); `none` would still mount the driver's libraries and tools, which a CPU-only
#: server has no use for
NO_DEVICES = "void"


ISOLATION = {
    "whole": "Exclusive: whole GPUs, yours alone while the server runs.",
    MIG: "MIG slice: hardware-isolated memory, compute and fault domain on a shared GPU.",
    HAMI: "HAMi: memory and compute limits enforced by HAMi's CUDA interposer; other users of the GPU share its fault domain.",
    TIME_SLICING: "Time-sliced GPU: turns on a shared GPU with no memory or fault isolation.",
    "cpu": "No GPU.",
}


class KubeProfileError(ValueError):
    """A profile cannot be expressed with the configured sharing backend."""


def product_label(model: str) -> str:
    """gpulab model name -> the NVIDIA GPU feature discovery label value."""
    return model if model.startswith("NVIDIA-") else f"NVIDIA-{model}"


def model_from_product(label: str) -> str:
    """GFD's product label -> gpulab's model name (GFD adds -SHARED on time-sliced nodes)."""
    label = label.removesuffix(SHARED_PRODUCT_SUFFIX)
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
    mig_profile: str | None = None,
    share_milli: int = 0,
) -> KubeGPUSpec:
    """Resource limits and constraints for one server.

    `gpu_memory_mib` is the memory of the GPU model the share is carved from (for MIG and HAMi);
    `node_name`, when the allocator chose a node, pins the pod there so the cluster and gpulab's
    accounting agree on where the share lives. `mig_profile` is the MIG instance the allocator
    placed the share on (else the smallest profile that holds it); `share_milli` what the share
    took there (HAMi rounds shares up to its split step), which HAMi's limits then grant.
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
            profile = mig_profile or mig_profile_for(gpu_memory_mib, gpu_milli)
            limits[f"{MIG_RESOURCE_PREFIX}{profile}"] = "1"
        elif sharing == HAMI:
            milli = max(gpu_milli, share_milli)
            limits[GPU_RESOURCE] = "1"
            limits[HAMI_MEMORY_RESOURCE] = str(gpu_memory_mib * milli // 1000)
            limits[HAMI_CORES_RESOURCE] = str(max(1, math.ceil(milli / 10)))
        else:
            limits[SHARED_GPU_RESOURCE] = "1"
        isolation = ISOLATION[sharing]
    else:
        isolation = ISOLATION["cpu"]

    terms: list[dict[str, Any]] = []
    models = sorted(gpu_models)
    if models and (num_gpu or gpu_milli):
        products = [product_label(m) for m in models]
        if gpu_milli and not num_gpu and sharing == TIME_SLICING:
            # GFD labels a node whose GPUs are time-sliced (renameByDefault) <product>-SHARED
            products = sorted({*products, *(p + SHARED_PRODUCT_SUFFIX for p in products)})
        terms.append({"key": PRODUCT_LABEL, "operator": "In", "values": products})
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


def share_environment(
    *,
    sharing: str,
    model: str,
    taken_milli: int,
    device_memory_mib: int,
    fractional: bool,
    mig_profile: str | None = None,
    inventory: str = "",
) -> dict[str, str]:
    """What a pod is told of its share, in the names the monitor and caps hook read.

    The device identities are the device plugin's to set (NVIDIA_VISIBLE_DEVICES, in the
    container); the hub states the rest: the model, the fraction the share holds (a MIG
    instance's or replica's part, a HAMi share rounded to its step) and its memory limit (the
    MIG instance's memory; HAMi's gpumem; for a time-slicing replica, its part of the GPU's
    memory, which nothing enforces). A CPU-only pod sees no GPU even where a runtime would
    expose all of them by default. `inventory` says the node's GPUs are simulated."""
    if not taken_milli:
        return {
            GPU_ENFORCEMENT_ENV: CPU_ONLY,
            VISIBLE_DEVICES_ENV: NO_DEVICES,
            "CUDA_VISIBLE_DEVICES": "",
        }
    env = {
        GPU_MODEL_ENV: f"{model} MIG {mig_profile}" if mig_profile else model,
        GPU_DEVICE_MEMORY_MIB_ENV: str(device_memory_mib),
    }
    if inventory:
        env[GPU_INVENTORY_ENV] = inventory
    if not fractional:
        env[GPU_ENFORCEMENT_ENV] = EXCLUSIVE
        return env
    limit = device_memory_mib if sharing == MIG else device_memory_mib * taken_milli // 1000
    env.update(
        {
            GPU_ENFORCEMENT_ENV: sharing,
            GPU_FRACTION_ENV: f"{taken_milli / 1000:.3f}",
            GPU_MEMORY_LIMIT_MIB_ENV: str(limit),
        }
    )
    return env


def container_device_environment(env: Mapping[str, str], *, holds_gpus: bool) -> dict[str, str]:
    """A server container's environment with its GPU visibility decided by the placement alone,
    whatever the image or the spawner's `environment` config say.

    An image may bake in `ENV NVIDIA_VISIBLE_DEVICES=all` (jupyter/docker-stacks' CUDA images
    do), and on a node whose default runtime is NVIDIA's that gives every GPU of the node to a
    container that asked for none. The runtime layers a container's environment: the image's ENV,
    then the device plugin's Allocate answer, then the pod spec's env (kubelet appends the pod's
    variables after the plugin's), each replacing the one before. So:
    - a pod that holds GPUs never names NVIDIA_VISIBLE_DEVICES in its spec: the device plugin's
      value, exactly the devices it allocated for the resources the placement requested (whole
      GPUs, a MIG instance, a HAMi or time-slicing share), replaces the image's; a value in the
      spec (`c.GPUKubeSpawner.environment`, say) would replace the plugin's and widen the share.
      gpulab cannot name the devices itself: Kubernetes does not tell it which physical GPU the
      plugin picks (see `nodes.node_from_k8s`);
    - a CPU-only pod gets `void`: no device plugin answers for it, so without it the image's
      value would stand.
    """
    out = dict(env)
    if holds_gpus:
        out.pop(VISIBLE_DEVICES_ENV, None)
    else:
        out[VISIBLE_DEVICES_ENV] = NO_DEVICES
    return out


@dataclass(frozen=True)
class PlacedPod:
    """What a pod holding a placement needs: its GPU spec (resource limits, the required node
    affinity that pins it to the allocator's node, spot tolerations, priority class) and what it
    is told of its share. A server's pod (GPUKubeSpawner) and a job's (job_objects) get the same."""

    gpu: KubeGPUSpec
    environment: dict[str, str]


def placed_pod(
    profile: Profile,
    placement: Placement,
    *,
    sharing: str,
    priority: str,
    device: GPU | None,
    gpu_memory_mib: int,
    priority_classes: Mapping[str, str] | None = None,
    inventory: str = "",
) -> PlacedPod:
    """The pod side of `placement` for `profile`. `device`: the allocator's GPU the placement's
    first share lies on (None without GPUs); `gpu_memory_mib`: the memory of its model;
    `priority`: "on-demand" or "preemptible" (a job's may differ from its profile's);
    `inventory`: the node's INVENTORY_LABEL ("simulated" GPUs are simulated by the monitor)."""
    # a fraction asks for the device the allocator counted the share on
    fraction_device = device if placement.gpus and profile.gpu_milli else None
    spec = gpu_spec(
        num_gpu=profile.num_gpu,
        gpu_milli=profile.gpu_milli,
        gpu_models=profile.gpu_models,
        gpu_memory_mib=gpu_memory_mib,
        sharing=sharing,
        priority=priority,
        node_name=placement.node,
        priority_classes=priority_classes,
        mig_profile=fraction_device.mig_profile if fraction_device is not None else None,
        share_milli=placement.gpus[0].milli if fraction_device is not None else 0,
    )
    environment = {
        PROFILE_ENV: profile.slug,
        ISOLATION_ENV: spec.isolation,
        GPU_SHARING_ENV: sharing if profile.gpu_milli else "",
        **share_environment(
            sharing=sharing,
            model=device.model if device is not None else "",
            taken_milli=sum(s.milli for s in placement.gpus),
            device_memory_mib=gpu_memory_mib,
            fractional=bool(profile.gpu_milli),
            mig_profile=device.mig_profile if device is not None else None,
            inventory=inventory,
        ),
    }
    return PlacedPod(gpu=spec, environment=environment)
