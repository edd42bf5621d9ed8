"""The cluster as gpulab's allocator sees it, kept current from watches of Nodes and Pods.

The cluster is the source of truth: each gpulab pod carries its placement in an annotation, so a
restarted hub rebuilds every allocation from the pods that exist, and a pod that disappears
(stopped, evicted, lost with its node) gives its share back. GPU pods not made by gpulab are
counted too, so the picker never offers GPUs another workload holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from gpulab.hub.allocator import (
    GPU,
    Allocator,
    GpuShare,
    Inventory,
    MemoryStore,
    Placement,
    Request,
)
from gpulab.hub.warmpool import is_pool_allocation
from gpulab.spawner.kube.gpu_resources import MIG
from gpulab.spawner.kube.nodes import inventory_from_nodes, node_is_ready, node_is_tainted
from gpulab.spawner.kube.objects import placement_from_pod
from gpulab.spawner.kube.reflector import WatchCache, object_key
from gpulab.spawner.names import (
    GPU_RESOURCE,
    HAMI_MEMORY_RESOURCE,
    HAMI_REGISTER_ANNOTATION,
    MIG_RESOURCE_PREFIX,
    PLACEHOLDER_LABEL,
    SHARED_GPU_RESOURCE,
)


def _pod_is_live(pod: dict[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase not in ("Succeeded", "Failed")


def _pod_gpu_limits(pod: dict[str, Any]) -> dict[str, int]:
    """GPU devices a pod's containers hold: nvidia.com/gpu, MIG instances, replicas; with
    HAMi's memory limit under the key HAMI_MEMORY_RESOURCE (MiB)."""
    total: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        for key, value in limits.items():
            if key in (GPU_RESOURCE, SHARED_GPU_RESOURCE, HAMI_MEMORY_RESOURCE) or key.startswith(
                MIG_RESOURCE_PREFIX
            ):
                try:
                    total[key] = total.get(key, 0) + int(str(value))
                except ValueError:
                    continue
    return {k: v for k, v in total.items() if v}


def _holds_gpus(pod: dict[str, Any]) -> bool:
    """Whether a pod gpulab did not make holds GPUs nobody else may be offered. A placeholder's
    do not count: the scheduler preempts it for the server the allocator places there."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(PLACEHOLDER_LABEL) == "true":
        return False
    limits = _pod_gpu_limits(pod)
    limits.pop(HAMI_MEMORY_RESOURCE, None)
    return bool(limits)


class KubeGPUState:
    """Node and pod caches plus the allocator built from them. `attach` hands it to GPUCapacity."""

    def __init__(
        self,
        core_api: Any,
        api_client: Any,
        *,
        policy: str,
        headroom_fraction: float,
        quota: Any,
        on_rebuild: Callable[[Allocator, Inventory], None],
        log: logging.Logger | None = None,
        sharing: str = MIG,
    ) -> None:
        self.log = log or logging.getLogger("gpulab.kube")
        #: the sharing backend fractions are placed on (GPUKubeSpawner.gpu_sharing)
        self.sharing = sharing
        self.policy, self.headroom_fraction, self.quota = policy, headroom_fraction, quota
        self.on_rebuild = on_rebuild
        self._node_signature: tuple[Any, ...] = ()
        self.allocator = Allocator(Inventory([]), policy=policy)
        self.not_ready_since: dict[str, float] = {}
        self.nodes = WatchCache(
            api_client, core_api.list_node, on_change=self._node_changed, log=self.log
        )
        self.pods = WatchCache(
            api_client,
            core_api.list_pod_for_all_namespaces,
            on_change=self._pod_changed,
            log=self.log,
        )

    def start(self) -> None:
        self.nodes.start()
        self.pods.start()

    async def wait_synced(self) -> None:
        await self.nodes.synced.wait()
        await self.pods.synced.wait()
        self._rebuild()

    # -- nodes ---------------------------------------------------------------------------------

    def _signature(self) -> tuple[Any, ...]:
        sig = []
        for key, node in sorted(self.nodes.objects.items()):
            status = node.get("status") or {}
            sig.append(
                (
                    key,
                    node_is_ready(node),
                    json.dumps(status.get("allocatable"), sort_keys=True),
                    # HAMi's device list (its nvidia.com/gpu counts virtual GPUs)
                    (node["metadata"].get("annotations") or {}).get(HAMI_REGISTER_ANNOTATION),
                    bool((node.get("spec") or {}).get("unschedulable")),
                    node_is_tainted(node),
                )
            )
        return tuple(sig)

    def _node_changed(self, kind: str, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        if kind != "DELETED" and not node_is_ready(node):
            self.not_ready_since.setdefault(name, time.monotonic())
        else:
            self.not_ready_since.pop(name, None)
        if self.pods.synced.is_set() and self._signature() != self._node_signature:
            self._rebuild()

    def node_failed_for(self, node_name: str) -> float:
        """Seconds the node has been NotReady or gone (0 when Ready)."""
        if node_name not in {n["metadata"]["name"] for n in self.nodes.objects.values()}:
            return float("inf") if self.nodes.synced.is_set() else 0.0
        since = self.not_ready_since.get(node_name)
        return 0.0 if since is None else time.monotonic() - since

    def _rebuild(self) -> None:
        """A fresh allocator over the Ready nodes holding every live pod's share."""
        self._node_signature = self._signature()
        inventory = inventory_from_nodes(self.nodes.objects.values(), self.sharing)
        placements: dict[str, Placement] = {}
        external: list[dict[str, Any]] = []
        for pod in self.pods.objects.values():
            if not _pod_is_live(pod):
                continue
            placement = placement_from_pod(pod)
            if placement is not None and self._given_away(placement):
                continue  # a warm member's pod on its way out: its GPUs are someone else's now
            if placement is not None:
                placements[placement.request.id] = placement
            elif _holds_gpus(pod) and (pod.get("spec") or {}).get("nodeName"):
                external.append(pod)
        # allocations made for pods that are not created yet stay reserved
        for placement in self.allocator.allocations():
            rid = placement.request.id
            if rid not in placements and not rid.startswith("external/"):
                placements[rid] = placement
        used: dict[str, int] = {}
        for placement in placements.values():
            for share in placement.gpus:
                used[share.uuid] = used.get(share.uuid, 0) + share.milli
        for pod in external:
            for placement in self._external_placements(pod, inventory, used):
                placements[placement.request.id] = placement
        store = MemoryStore()
        store.commit(list(placements.values()), [])
        allocator = Allocator(
            inventory,
            policy=self.policy,
            headroom_fraction=self.headroom_fraction,
            quota=self.quota,
            store=store,
        )
        for stale in allocator.stale:
            self.log.warning(
                "GPU allocation %s no longer fits the cluster: %s", stale.placement.id, stale.reason
            )
        self.allocator = allocator
        self.on_rebuild(allocator, inventory)

    def _given_away(self, placement: Placement) -> bool:
        """Whether `placement` is a warm pool member's reservation this hub has since handed
        over to a user's start or given to an on-demand one (the live allocator no longer holds
        it, and a later allocation holds its GPUs): its pod is being deleted and must not count
        twice. A restarted hub's first view holds nothing yet, so every member pod counts."""
        if not is_pool_allocation(placement.request.id) or not placement.gpus:
            return False
        if self.allocator.get(placement.request.id) is not None:
            return False
        uuids = {s.uuid for s in placement.gpus}
        return any(
            held.created_at > placement.created_at and uuids & {s.uuid for s in held.gpus}
            for held in self.allocator.allocations()
        )

    # -- pods ----------------------------------------------------------------------------------

    @staticmethod
    def _external_placements(
        pod: dict[str, Any], inventory: Inventory, used: dict[str, int]
    ) -> list[Placement]:
        """A GPU pod gpulab did not make holds devices on its node: count the least used ones
        of each kind it asked for (whole GPUs, MIG instances of its profile, replicas, a HAMi
        share of its memory limit), so nobody is offered what it holds."""
        node_name = pod["spec"]["nodeName"]
        node = next((n for n in inventory.nodes if n.name == node_name), None)
        if node is None:
            return []
        limits = _pod_gpu_limits(pod)
        hami_mib = limits.pop(HAMI_MEMORY_RESOURCE, 0)
        key = object_key(pod)
        out: list[Placement] = []

        def hold(devices: list[GPU], count: int, milli_of: Callable[[GPU], int]) -> None:
            free = sorted(
                (g for g in devices if used.get(g.uuid, 0) + milli_of(g) <= g.capacity_milli),
                key=lambda g: (used.get(g.uuid, 0), g.index),
            )
            for g in free[:count]:
                milli = milli_of(g)
                used[g.uuid] = used.get(g.uuid, 0) + milli
                whole = milli == 1000 and g.capacity_milli == 1000
                out.append(
                    Placement(
                        request=Request(
                            id=f"external/{key}/{len(out)}",
                            num_gpu=1 if whole else 0,
                            gpu_milli=0 if whole else milli,
                        ),
                        node=node_name,
                        gpus=(GpuShare(g.uuid, milli),),
                        created_at=time.time(),
                    )
                )

        whole_gpus = [g for g in node.gpus if g.capacity_milli == 1000]
        for resource, count in limits.items():
            if resource == GPU_RESOURCE and hami_mib:
                hold(
                    whole_gpus,
                    count,
                    lambda g: (
                        g.take_milli(max(1, -(-hami_mib * 1000 // max(1, g.memory_mib)))) or 1000
                    ),
                )
            elif resource == GPU_RESOURCE:
                hold([g for g in whole_gpus if used.get(g.uuid, 0) == 0], count, lambda g: 1000)
            elif resource.startswith(MIG_RESOURCE_PREFIX):
                profile = resource[len(MIG_RESOURCE_PREFIX) :]
                parts = [g for g in node.gpus if g.mig_profile == profile]
                hold(parts, count, lambda g: g.capacity_milli)
            elif resource == SHARED_GPU_RESOURCE:
                replicas = [g for g in node.gpus if "/replica-" in g.uuid]
                hold(replicas, count, lambda g: g.capacity_milli)
        return out

    def _pod_changed(self, kind: str, pod: dict[str, Any]) -> None:
        if not self.pods.synced.is_set():
            return
        placement = placement_from_pod(pod)
        if placement is None:
            if _holds_gpus(pod) and (pod.get("spec") or {}).get("nodeName"):
                self._rebuild()  # another workload's GPUs appeared or went away
            return
        if kind == "DELETED" or not _pod_is_live(pod):
            current = self.allocator.get(placement.request.id)
            # only the pod that holds this placement releases it (a new pod may reuse the id)
            if current is not None and current.created_at == placement.created_at:
                self.allocator.release(placement.request.id)


_state: KubeGPUState | None = None
_state_lock: asyncio.Lock | None = None


async def ensure_kube_state(
    capacity: Any, *, sharing: str | None = None, timeout: float = 60.0
) -> KubeGPUState:
    """The hub's one cluster view, started and synced on first use, attached to `capacity`.

    Client configuration comes from the pod's service account inside a cluster, else from the
    kubeconfig (KUBECONFIG), exactly as KubeSpawner loads it."""
    global _state, _state_lock
    if _state is not None:
        return _state
    if _state_lock is None:
        _state_lock = asyncio.Lock()
    async with _state_lock:
        if _state is None:
            from kubespawner.clients import load_config, shared_client

            await asyncio.to_thread(load_config)
            api = shared_client("CoreV1Api")

            def attach(allocator: Allocator, inventory: Inventory) -> None:
                gpus = sum(1 for n in inventory.nodes for g in n.gpus if g.capacity_milli == 1000)
                parts = sum(len(n.gpus) for n in inventory.nodes) - gpus
                models = ", ".join(sorted(inventory.models)) or "no GPUs"
                shared = f", {parts} MIG instances or replicas" if parts else ""
                capacity.attach(
                    allocator,
                    inventory,
                    f"Kubernetes: {len(inventory.nodes)} nodes, {gpus} GPUs{shared} ({models})",
                )

            state = KubeGPUState(
                api,
                api.api_client,
                policy=capacity.placement_policy,
                headroom_fraction=capacity.headroom_fraction,
                quota=capacity.quota,
                on_rebuild=attach,
                log=capacity.log,
                sharing=sharing or configured_sharing(capacity.config),
            )
            state.start()
            await asyncio.wait_for(state.wait_synced(), timeout)
            _state = state
    return _state


def configured_sharing(config: Any) -> str:
    """GPUKubeSpawner.gpu_sharing as the hub's config sets it (GPUCapacity builds the cluster
    view before any spawner exists); the trait's own validation runs when a spawner starts."""
    section = config.get("GPUKubeSpawner") if config is not None else None
    value = section.get("gpu_sharing") if section is not None else None
    return str(value) if value else MIG
