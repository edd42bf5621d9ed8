"""What the NVIDIA and HAMi device plugins hand a container: its devices, as environment.

Each simulated GPU has an ID (GPU-<node>-<index>), each MIG instance one (MIG-<node>-<profile>-<k>);
time-slicing replicas map to their GPU. A container that asks for `nvidia.com/gpu`,
`nvidia.com/mig-*` or `nvidia.com/gpu.shared` gets distinct devices in NVIDIA_VISIBLE_DEVICES,
as the device plugin sets it; HAMi's `nvidia.com/gpumem`/`gpucores` limits appear as
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

from ..spec import NodeSpec
from .kube import log

GPU = GPU_RESOURCE
SHARED = SHARED_GPU_RESOURCE
MIG_PREFIX = MIG_RESOURCE_PREFIX


class Devices:
    def __init__(self, spec: NodeSpec) -> None:
        gpus = [f"GPU-{spec.name}-{i}" for i in range(spec.gpus)]
        # resource -> slots; a slot is (slot id, device id the container sees)
        self.pools: dict[str, list[tuple[str, str]]] = {GPU: [(g, g) for g in gpus]}
        for profile, count in sorted(spec.mig.items()):
            ids = [f"MIG-{spec.name}-{profile}-{k}" for k in range(count)]
            self.pools[MIG_PREFIX + profile] = [(m, m) for m in ids]
        if spec.time_slicing_replicas:
            self.pools[SHARED] = [
                (f"{g}::{r}", g) for r in range(spec.time_slicing_replicas) for g in gpus
            ]
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
