"""Simulated GPU nodes: what a node offers (NodeSpec) and the Node object it becomes.

Pure data and functions; neither Kubernetes clients nor processes. The resource and label names
are the ones real GPU operators publish, so schedulers and spawners see what they would see on a
GPU cluster:

- ``nvidia.com/gpu`` (device plugin), ``nvidia.com/mig-<profile>`` (MIG, mixed strategy),
  ``nvidia.com/gpu.shared`` (time-slicing with ``renameByDefault``),
  ``nvidia.com/gpumem`` (MiB) and ``nvidia.com/gpucores`` (100 per GPU) from HAMi;
- labels ``nvidia.com/gpu.product``, ``nvidia.com/gpu.count``, ``nvidia.com/gpu.memory``,
  ``topology.kubernetes.io/zone``, ``gpulab.io/rack``, ``kubernetes.io/hostname``.

As on a real node, one GPU is offered one way: a MIG-enabled GPU only as its MIG instances
(``nvidia.com/gpu`` counts the others, the mixed strategy), a time-sliced GPU only as its
replicas (``renameByDefault``: no ``nvidia.com/gpu`` for it, and GFD's product label gets
``-SHARED``), a HAMi GPU as ``split`` virtual GPUs (``nvidia.com/gpu`` = GPUs x split count, the
devices listed in HAMi's registration annotation).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

# the names the kube spawner and the allocator read on Nodes: one spelling for both sides
from gpulab.devcluster.build import KUBE_VERSION
from gpulab.spawner.names import (
    GPU_COUNT_LABEL,
    GPU_MEMORY_LABEL,
    GPU_REPLICAS_LABEL,
    GPU_RESOURCE,
    HAMI_CORES_RESOURCE,
    HAMI_MEMORY_RESOURCE,
    HAMI_REGISTER_ANNOTATION,
    HOSTNAME_LABEL,
    MIG_RESOURCE_PREFIX,
    MIG_STRATEGY_LABEL,
    PRODUCT_LABEL,
    RACK_LABEL,
    SHARED_GPU_RESOURCE,
    SHARED_PRODUCT_SUFFIX,
    SIMULATED_NODE_ANNOTATION,
    SPOT_LABEL,
    SPOT_TAINT_KEY,
    ZONE_LABEL,
)

#: what the nodes' kubelets report: the control plane's own release, as a cluster's nodes run
KUBELET_VERSION = f"v{KUBE_VERSION}"
#: the features a node declares (`status.declaredFeatures`, NodeDeclaredFeatures GA in 1.37),
#: only those the agent implements. ExtendWebSocketsToKubelet: the API server passes exec and
#: attach on to the kubelet API as the client asked (websocket, v5.channel.k8s.io from kubectl
#: 1.30+) instead of translating them to SPDY, which the agent's kubelet API does not speak.
DECLARED_FEATURES = ("ExtendWebSocketsToKubelet",)

TIME_SLICING, HAMI = "time-slicing", "hami"
#: replicas per time-sliced GPU, virtual GPUs per HAMi GPU (HAMi's deviceSplitCount default)
DEFAULT_REPLICAS = {TIME_SLICING: 4, HAMI: 10}
_MIG_PROFILE = re.compile(r"^([1-7])g\.(\d+)gb$")


def mig_profile_size(profile: str) -> tuple[int, int]:
    """'2g.20gb' -> (2 compute slices of 7, 20 GB)."""
    m = _MIG_PROFILE.match(profile)
    if not m:
        raise ValueError(f"{profile!r} is not a MIG profile like '2g.20gb'")
    return int(m.group(1)), int(m.group(2))


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
    # the MIG layout of each MIG-enabled GPU, profile -> instances, e.g. {"3g.40gb": 1,
    # "2g.20gb": 1, "1g.10gb": 2}; mig_gpus of the node's gpus are MIG-enabled (all by default)
    mig: dict[str, int] = field(default_factory=dict)
    mig_gpus: int | None = None
    # how the other GPUs are offered: "" (whole), "time-slicing" (nvidia.com/gpu.shared) or
    # "hami"; replicas: time-slicing replicas / HAMi virtual GPUs per GPU (0: the default)
    sharing: str = ""
    replicas: int = 0
    # spot/preemptible pool: label gpulab.io/capacity-type=spot and a NoSchedule taint
    spot: bool = False
    pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    # extra taints as Kubernetes dicts: {"key": ..., "value": ..., "effect": "NoSchedule"}
    taints: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower() or " " in self.name:
            raise ValueError(f"NodeSpec.name {self.name!r} must be a lower-case DNS name")
        for attr in ("gpus", "cpu", "memory_gib", "gpu_memory_mib", "replicas"):
            if getattr(self, attr) < 0:
                raise ValueError(f"NodeSpec.{attr} must be >= 0, not {getattr(self, attr)}")
        if self.sharing not in ("", TIME_SLICING, HAMI):
            raise ValueError(
                f"NodeSpec.sharing must be '', {TIME_SLICING!r} or {HAMI!r}, not {self.sharing!r}"
            )
        if self.mig_gpus is not None and not 0 <= self.mig_gpus <= self.gpus:
            raise ValueError(
                f"NodeSpec.mig_gpus must be 0..gpus ({self.gpus}), not {self.mig_gpus}"
            )
        slices = memory = 0
        for profile, count in self.mig.items():
            try:
                g, gb = mig_profile_size(profile)
            except ValueError as e:
                raise ValueError(f"NodeSpec.mig: {e}") from None
            if count < 0:
                raise ValueError(f"NodeSpec.mig[{profile!r}] must be a count >= 0, not {count}")
            slices, memory = slices + g * count, memory + gb * count
        if slices > 7 or memory * 1024 > self.gpu_memory_mib * 1.01:
            raise ValueError(
                f"NodeSpec.mig: {self.mig} does not fit one GPU ({slices} of 7 compute slices, "
                f"{memory} GB of {self.gpu_memory_mib // 1024} GB)"
            )

    @property
    def mig_enabled_gpus(self) -> int:
        """GPUs in MIG mode: the first ones of the node."""
        if not self.mig:
            return 0
        return self.gpus if self.mig_gpus is None else self.mig_gpus

    @property
    def plain_gpus(self) -> int:
        """GPUs not in MIG mode, offered whole, time-sliced or through HAMi."""
        return self.gpus - self.mig_enabled_gpus

    @property
    def split(self) -> int:
        """Replicas (time-slicing) or virtual GPUs (HAMi) per plain GPU; 1 when offered whole."""
        return self.replicas or DEFAULT_REPLICAS.get(self.sharing, 1)

    def gpu_id(self, index: int) -> str:
        """The device ID of GPU index (what NVIDIA_VISIBLE_DEVICES and HAMi name)."""
        return f"GPU-{self.name}-{index}"

    def mig_instances(self) -> list[tuple[str, str, int]]:
        """(MIG instance ID, profile, parent GPU index) of every MIG instance."""
        return [
            (f"MIG-{self.name}-{gpu}-{profile}-{k}", profile, gpu)
            for gpu in range(self.mig_enabled_gpus)
            for profile, count in sorted(self.mig.items())
            for k in range(count)
        ]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeSpec:
        return cls(**data)


def default_nodes() -> list[NodeSpec]:
    """The demo cluster: two A100 nodes in two racks, one MIG node and a spot H100 node."""
    return [
        NodeSpec("gpu-a100-0", zone="zone-a", rack="rack-1"),
        NodeSpec("gpu-a100-1", zone="zone-a", rack="rack-2", sharing=TIME_SLICING),
        NodeSpec(
            "gpu-mig-0",
            gpus=2,
            zone="zone-b",
            rack="rack-3",
            mig={"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2},
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
    plain = spec.plain_gpus
    if plain and spec.sharing == TIME_SLICING:
        cap[SHARED_GPU_RESOURCE] = str(plain * spec.split)
    elif plain:
        cap[GPU_RESOURCE] = str(plain * spec.split)
    if plain and spec.sharing == HAMI:
        cap[HAMI_MEMORY_RESOURCE] = str(plain * spec.gpu_memory_mib)
        cap[HAMI_CORES_RESOURCE] = str(plain * 100)
    for profile, count in sorted(spec.mig.items()):
        if count and spec.mig_enabled_gpus:
            cap[MIG_RESOURCE_PREFIX + profile] = str(count * spec.mig_enabled_gpus)
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
    if spec.gpus:
        shared = spec.sharing == TIME_SLICING and spec.plain_gpus
        out["nvidia.com/gpu.present"] = "true"
        out[PRODUCT_LABEL] = spec.gpu_product + (SHARED_PRODUCT_SUFFIX if shared else "")
        out[GPU_COUNT_LABEL] = str(spec.gpus)
        out[GPU_MEMORY_LABEL] = str(spec.gpu_memory_mib)
    if spec.mig_enabled_gpus:
        out[MIG_STRATEGY_LABEL] = "mixed"
        for profile, count in sorted(spec.mig.items()):
            out[f"{MIG_RESOURCE_PREFIX}{profile}.count"] = str(count * spec.mig_enabled_gpus)
    if spec.sharing == TIME_SLICING and spec.plain_gpus:
        out[GPU_REPLICAS_LABEL] = str(spec.split)
        out["nvidia.com/gpu.sharing-strategy"] = "time-slicing"
    if spec.sharing == HAMI and spec.plain_gpus:
        out["gpu"] = "on"  # HAMi's scheduler selects nodes by this label
    out.update(spec.labels)
    return out


def annotations(spec: NodeSpec) -> dict[str, str]:
    """HAMi's registration of the node's HAMi GPUs (the format HAMi's device plugin writes)."""
    if spec.sharing != HAMI or not spec.plain_gpus:
        return {}
    devices = [
        f"{spec.gpu_id(i)},{spec.split},{spec.gpu_memory_mib},100,{spec.gpu_product},0,true"
        for i in range(spec.mig_enabled_gpus, spec.gpus)
    ]
    return {HAMI_REGISTER_ANNOTATION: ":".join(devices)}


def taints(spec: NodeSpec) -> list[dict[str, str]]:
    out = [dict(t) for t in spec.taints]
    if spec.spot:
        out.append({"key": SPOT_TAINT_KEY, "value": "true", "effect": "NoSchedule"})
    return out


def node_manifest(
    spec: NodeSpec, *, internal_ip: str, pod_cidr: str | None = None
) -> dict[str, Any]:
    """The Node object as a kubelet registers it (status is patched separately); pod_cidr: the
    node's pod addresses (set once: the API server refuses to change it)."""
    node_spec: dict[str, Any] = {"taints": taints(spec)} if taints(spec) else {}
    if pod_cidr:
        node_spec.update(podCIDR=pod_cidr, podCIDRs=[pod_cidr])
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "labels": labels(spec),
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                SIMULATED_NODE_ANNOTATION: "true",
                "gpulab.io/internal-ip": internal_ip,
                **annotations(spec),
            },
        },
        "spec": node_spec,
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
