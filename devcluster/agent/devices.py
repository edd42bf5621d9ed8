"""What the NVIDIA and HAMi device plugins hand a container: its devices, as environment.

Each simulated GPU has an ID (GPU-<node>-<index>), each MIG instance one
(MIG-<node>-<parent index>-<profile>-<k>); time-slicing replicas and HAMi's virtual GPUs map to
their GPU. A GPU is offered one way only (see spec.py): a container that asks for
`nvidia.com/gpu`, `nvidia.com/mig-*` or `nvidia.com/gpu.shared` gets distinct devices in
NVIDIA_VISIBLE_DEVICES, as the device plugin sets it (HAMi: each virtual GPU of a container on a
different GPU); HAMi's `nvidia.com/gpumem`/`gpucores` limits appear as
CUDA_DEVICE_MEMORY_LIMIT_<i> (MiB, "m" suffix) and CUDA_DEVICE_SM_LIMIT. Nothing is enforced.
"""

from __future__ import annotations

from typing import Any

from gpulab.spawner.names import (
    GPU_RESOURCE,
    HAMI_CORES_RESOURCE,
    HAMI_MEMORY_RESOURCE,
    MIG_RESOURCE_PREFIX,
    SHARED_GPU_RESOURCE,
)

from ..spec import HAMI, TIME_SLICING, NodeSpec
from .kube import log

GPU = GPU_RESOURCE
SHARED = SHARED_GPU_RESOURCE
MIG_PREFIX = MIG_RESOURCE_PREFIX


class Devices:
    def __init__(self, spec: NodeSpec) -> None:
        plain = [spec.gpu_id(i) for i in range(spec.mig_enabled_gpus, spec.gpus)]
        # resource -> slots; a slot is (slot id, device id the container sees)
        self.pools: dict[str, list[tuple[str, str]]] = {}
        if spec.sharing == TIME_SLICING:
            self.pools[SHARED] = [(f"{g}::{r}", g) for r in range(spec.split) for g in plain]
        elif spec.sharing == HAMI:
            self.pools[GPU] = [(f"{g}::{k}", g) for k in range(spec.split) for g in plain]
        else:
            self.pools[GPU] = [(g, g) for g in plain]
        for mig_id, profile, _parent in spec.mig_instances():
            self.pools.setdefault(MIG_PREFIX + profile, []).append((mig_id, mig_id))
        #: HAMi: a container's virtual GPUs sit on different GPUs
        self.distinct = {GPU} if spec.sharing == HAMI else set()
        self.used: dict[str, set[str]] = {}  # owner -> slot ids

    def _taken(self) -> set[str]:
        return set().union(*self.used.values()) if self.used else set()

    def allocate(self, owner: str, container: dict[str, Any]) -> dict[str, str]:
        """Env for one container (owner: pod uid + container name); same answer when repeated."""
        resources = container.get("resources") or {}
        limits = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        taken = self._taken() - self.used.get(owner, set())
        mine = self.used.setdefault(owner, set())
        visible: list[str] = []
        for resource, pool in self.pools.items():
            want = int(str(limits.get(resource, 0)) or 0)
            have = [(s, d) for s, d in pool if s in mine]
            free = [(s, d) for s, d in pool if s not in taken and s not in mine]
            if resource in self.distinct:  # at most one of the container's slots per GPU
                on = {d for _, d in have}
                one_each = []
                for slot, device in free:
                    if device not in on:
                        on.add(device)
                        one_each.append((slot, device))
                free = one_each
            if len(have) + len(free) < want:
                log.warning(
                    "%s: %s asks %d %s, %d free",
                    owner,
                    container.get("name"),
                    want,
                    resource,
                    len(free),
                )
            chosen = (have + free)[:want]
            mine.update(s for s, _ in chosen)
            visible += [d for _, d in chosen]
        env: dict[str, str] = {}
        if visible:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(visible))
        if HAMI_MEMORY_RESOURCE in limits:
            for i in range(len(dict.fromkeys(visible)) or 1):
                env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{limits[HAMI_MEMORY_RESOURCE]}m"
        if HAMI_CORES_RESOURCE in limits:
            env["CUDA_DEVICE_SM_LIMIT"] = str(limits[HAMI_CORES_RESOURCE])
        return env

    def release(self, prefix: str) -> None:
        """Free every allocation whose owner starts with prefix (a pod's uid)."""
        for owner in [o for o in self.used if o.startswith(prefix)]:
            del self.used[owner]
