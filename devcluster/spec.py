"""Simulated GPU nodes: what a node offers (NodeSpec) and the Node object it becomes.

Pure data and functions; neither Kubernetes clients nor processes. The resource and label names
are the ones real GPU operators publish, so schedulers and spawners see what they would see on a
GPU cluster:

- ``nvidia.com/gpu`` (device plugin), ``nvidia.com/mig-<profile>`` (MIG, mixed strategy),
  ``nvidia.com/gpu.shared`` (time-slicing with ``renameByDefault``),
  ``nvidia.com/gpumem`` (MiB) and ``nvidia.com/gpucores`` (100 per GPU) from HAMi;
- labels ``nvidia.com/gpu.product``, ``nvidia.com/gpu.count``, ``nvidia.com/gpu.memory``,
  ``topology.kubernetes.io/zone``, ``gpulab.io/rack``, ``kubernetes.io/hostname``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# the names the kube spawner and the allocator read on Nodes: one spelling for both sides
from gpulab.spawner.names import (
    GPU_RESOURCE,
    HAMI_CORES_RESOURCE,
    HAMI_MEMORY_RESOURCE,
    HOSTNAME_LABEL,
    MIG_RESOURCE_PREFIX,
    PRODUCT_LABEL,
    RACK_LABEL,
    SHARED_GPU_RESOURCE,
    SPOT_LABEL,
    SPOT_TAINT_KEY,
    ZONE_LABEL,
)

KUBELET_VERSION = "v1.20.2"


@dataclass(frozen=True)
class NodeSpec:
    """One simulated node. Defaults describe an 8x A100-80GB box."""

    name: str
    gpus: int = 8
    gpu_product: str = "NVIDIA-A100-SXM4-80GB"
    gpu_memory_mib: int = 81920  # per GPU
    cpu: int = 64  # cores
    memory_gib: int = 512
    zone: str = "zone-a"
    rack: str = "rack-1"
    # MIG instances the node advertises, profile -> count, e.g. {"1g.10gb": 7, "3g.40gb": 2}
    mig: dict[str, int] = field(default_factory=dict)
    # time-slicing replicas per GPU; > 0 advertises nvidia.com/gpu.shared = gpus * replicas
    time_slicing_replicas: int = 0
    # HAMi's nvidia.com/gpumem (MiB, all GPUs) and nvidia.com/gpucores (100 per GPU)
    hami: bool = True
    # spot/preemptible pool: label gpulab.io/capacity-type=spot and a NoSchedule taint
    spot: bool = False
    pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    # extra taints as Kubernetes dicts: {"key": ..., "value": ..., "effect": "NoSchedule"}
    taints: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower() or " " in self.name:
            raise ValueError(f"NodeSpec.name {self.name!r} must be a lower-case DNS name")
        for attr in ("gpus", "cpu", "memory_gib", "gpu_memory_mib", "time_slicing_replicas"):
            if getattr(self, attr) < 0:
                raise ValueError(f"NodeSpec.{attr} must be >= 0, not {getattr(self, attr)}")
        for profile, count in self.mig.items():
            if count < 0 or not profile:
                raise ValueError(f"NodeSpec.mig[{profile!r}] must be a count >= 0, not {count}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeSpec:
        return cls(**data)


def default_nodes() -> list[NodeSpec]:
    """The demo cluster: two A100 nodes in two racks, one MIG node and a spot H100 node."""
    return [
        NodeSpec("gpu-a100-0", zone="zone-a", rack="rack-1"),
        NodeSpec("gpu-a100-1", zone="zone-a", rack="rack-2", time_slicing_replicas=4),
        NodeSpec(
            "gpu-mig-0", gpus=0, zone="zone-b", rack="rack-3", mig={"1g.10gb": 14, "3g.40gb": 4}
        ),
        NodeSpec(
            "gpu-h100-spot-0",
            gpus=4,
            gpu_product="NVIDIA-H100-80GB-HBM3",
            zone="zone-b",
            rack="rack-4",
            spot=True,
        ),
    ]


def capacity(spec: NodeSpec) -> dict[str, str]:
    """status.capacity (and allocatable: the simulation reserves nothing)."""
    cap = {
        "cpu": str(spec.cpu),
        "memory": f"{spec.memory_gib}Gi",
        "pods": str(spec.pods),
        "ephemeral-storage": "1Ti",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
    }
    if spec.gpus:
        cap[GPU_RESOURCE] = str(spec.gpus)
    for profile, count in sorted(spec.mig.items()):
        cap[MIG_RESOURCE_PREFIX + profile] = str(count)
    if spec.time_slicing_replicas:
        cap[SHARED_GPU_RESOURCE] = str(spec.gpus * spec.time_slicing_replicas)
    if spec.hami and spec.gpus:
        cap[HAMI_MEMORY_RESOURCE] = str(spec.gpus * spec.gpu_memory_mib)
        cap[HAMI_CORES_RESOURCE] = str(spec.gpus * 100)
    return cap


def labels(spec: NodeSpec) -> dict[str, str]:
    out = {
        HOSTNAME_LABEL: spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": "amd64",
        ZONE_LABEL: spec.zone,
        "failure-domain.beta.kubernetes.io/zone": spec.zone,
        RACK_LABEL: spec.rack,
        "gpulab.io/node-agent": "true",
        SPOT_LABEL: "spot" if spec.spot else "on-demand",
    }
    if spec.gpus or spec.mig:
        out["nvidia.com/gpu.present"] = "true"
        out[PRODUCT_LABEL] = spec.gpu_product
        out["nvidia.com/gpu.count"] = str(spec.gpus)
        out["nvidia.com/gpu.memory"] = str(spec.gpu_memory_mib)
    if spec.mig:
        out["nvidia.com/mig.strategy"] = "mixed"
    if spec.time_slicing_replicas:
        out["nvidia.com/gpu.replicas"] = str(spec.time_slicing_replicas)
        out["nvidia.com/gpu.sharing-strategy"] = "time-slicing"
    if spec.hami and spec.gpus:
        out["gpu"] = "on"  # HAMi's scheduler selects nodes by this label
    out.update(spec.labels)
    return out


def taints(spec: NodeSpec) -> list[dict[str, str]]:
    out = [dict(t) for t in spec.taints]
    if spec.spot:
        out.append({"key": SPOT_TAINT_KEY, "value": "true", "effect": "NoSchedule"})
    return out


def node_manifest(spec: NodeSpec, *, internal_ip: str) -> dict[str, Any]:
    """The Node object as a kubelet registers it (status is patched separately)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "labels": labels(spec),
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "gpulab.io/simulated": "true",
                "gpulab.io/internal-ip": internal_ip,
            },
        },
        "spec": {"taints": taints(spec)} if taints(spec) else {},
    }


def node_info(spec: NodeSpec) -> dict[str, str]:
    return {
        "machineID": f"gpulab-{spec.name}",
        "systemUUID": f"gpulab-{spec.name}",
        "bootID": f"gpulab-{spec.name}",
        "kernelVersion": "simulated",
        "osImage": "gpulab node agent",
        "containerRuntimeVersion": "gpulab-agent://0.1",
        "kubeletVersion": KUBELET_VERSION,
        "kubeProxyVersion": KUBELET_VERSION,
        "operatingSystem": "linux",
        "architecture": "amd64",
    }
