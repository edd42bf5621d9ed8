"""Warm pool members on Kubernetes (`GPUWarmPool`'s backend for GPUKubeSpawner): warm capacity.

A pod's volumes are fixed when it is created, so a pre-started pod can never become a user's
server (her home claim, her checkpoint key, her token). A member here is a placeholder pod the
hub makes for the member's reservation (preemptible, owner `gpulab:warm-pool`): on the node and
devices the allocator reserved, with the GPU limits, node affinity, tolerations and priority class
a server of its profile gets (`gpu_resources.placed_pod`), the reservation in its placement
annotation (so a restarted hub's cluster view counts it, under the member's id), the profile's
server image pulled by an init container and the pause image holding the devices
(`objects.warm_member_pod_manifest`). Ready = Running on its node: the image is on the node, the
device plugin allocated the devices.

A claim (GPUKubeSpawner.load_user_options) hands the reservation over to the user's request,
deletes the member pod and creates her own pod, fresh, on the same node and devices. It saves
what a cold start waits for before its pod runs on a real cluster (a node scale-up, the image
pull, the device plugin), not the server's own start.

Security: a member holds no tenant's data, token, volume or environment; it runs the pause
image as uid 65535 with nothing to escalate; only the hub (which has the pods API of its
namespace) makes, claims and deletes members, and a claim makes her pod anew, so nothing of a
member is ever part of a user's server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.profiles import Profile
from gpulab.hub.warmpoolservice import WarmStartFailed
from gpulab.spawner.kube.gpu_resources import PlacedPod
from gpulab.spawner.kube.objects import (
    PAUSE_IMAGE,
    dns_name,
    placement_from_pod,
    priority_class_manifest,
    warm_member_pod_manifest,
)
from gpulab.spawner.names import WARM_MEMBER_LABEL

#: how long a discarded member's pod may take to go (grace 1 s: the pause container exits on
#: SIGTERM at once)
DISCARD_TIMEOUT = 30.0
POLL_SECONDS = 0.2


def member_pod_name(member_id: str) -> str:
    """`gpulab-warm-<slug>-<n>-<random>`: a DNS name; the random part keeps a pod of a previous
    hub process (same serial) from colliding with a new one."""
    tail = member_id.rsplit("/", 1)[-1]
    return dns_name(f"gpulab-warm-{tail}-{secrets.token_hex(3)}", 63)


class KubeWarmMember:
    """One member pod, seen through the hub's pod watch (`KubeGPUState.pods`)."""

    def __init__(
        self,
        backend: KubeWarmBackend,
        member_id: str,
        profile: str,
        fingerprint: str,
        pod_name: str,
        node: str,
    ) -> None:
        self.backend = backend
        self.id = member_id
        self.profile = profile
        self.fingerprint = fingerprint
        self.pod_name = pod_name
        self.node = node
        self.started_at = time.monotonic()
        self._seen = False
        self._discarded = False

    def _pod(self) -> dict[str, Any] | None:
        pod = self.backend.watched_pod(self.pod_name)
        if pod is not None:
            self._seen = True
        return pod

    @property
    def ready(self) -> bool:
        pod = self._pod()
        if pod is None or self._discarded:
            return False
        return (pod.get("status") or {}).get("phase") == "Running" and (pod.get("spec") or {}).get(
            "nodeName"
        ) == self.node

    @property
    def alive(self) -> bool:
        if self._discarded:
            return False
        pod = self._pod()
        if pod is None:
            return not self._seen  # created, not in the watch yet
        phase = (pod.get("status") or {}).get("phase")
        return phase not in ("Succeeded", "Failed") and not (pod.get("metadata") or {}).get(
            "deletionTimestamp"
        )

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if not self.alive:
                raise WarmStartFailed(f"member pod {self.pod_name} ended before it ran")
            pod = self._pod()
            node = ((pod or {}).get("spec") or {}).get("nodeName")
            if node and node != self.node:
                raise WarmStartFailed(
                    f"member pod {self.pod_name} was bound to {node}, not {self.node}"
                )
            if time.monotonic() > deadline:
                phase = ((pod or {}).get("status") or {}).get("phase", "not seen")
                raise WarmStartFailed(
                    f"member pod {self.pod_name} not Running on {self.node} in {timeout:.0f} s "
                    f"({phase})"
                )
            await asyncio.sleep(POLL_SECONDS)

    async def discard(self) -> None:
        """Delete the pod and return once it is gone (its devices are free for her pod)."""
        self._discarded = True
        await self.backend.delete_pod(self.pod_name)


class KubeWarmBackend:
    """Makes, finds and deletes member pods in the servers' namespace (the hub's own client)."""

    def __init__(
        self,
        *,
        namespace: str,
        image: str,
        sharing: str,
        priority_classes: dict[str, tuple[str, int]],
        placed_pod: Callable[[Profile, Placement], PlacedPod],
        ensure_state: Callable[[], Any],
        pause_image: str = PAUSE_IMAGE,
        image_pull_policy: str | None = None,
        labels: dict[str, str] | None = None,
        log: Any = None,
    ) -> None:
        self.namespace = namespace
        self.image = image
        self.sharing = sharing
        self.priority_classes = priority_classes
        self.placed_pod = placed_pod
        self.ensure_state = ensure_state
        self.pause_image = pause_image
        self.image_pull_policy = image_pull_policy
        self.labels = dict(labels or {})
        self.log = log
        self._state: Any = None
        self._api: Any = None
        self._classes_ready = False

    # -- the cluster -----------------------------------------------------------------------------

    async def _core(self) -> Any:
        if self._state is None:
            self._state = await self.ensure_state()  # loads the client config, as the spawner
        if self._api is None:
            from kubespawner.clients import shared_client  # type: ignore[import-untyped]

            self._api = shared_client("CoreV1Api")
        return self._api

    def watched_pod(self, name: str) -> dict[str, Any] | None:
        if self._state is None:
            return None
        pod: dict[str, Any] | None = self._state.pods.objects.get(f"{self.namespace}/{name}")
        return pod

    async def _ensure_priority_classes(self, api: Any) -> None:
        if self._classes_ready:
            return
        from kubernetes_asyncio.client import SchedulingV1Api
        from kubernetes_asyncio.client.exceptions import ApiException

        scheduling = SchedulingV1Api(api.api_client)
        for priority, (name, value) in self.priority_classes.items():
            body: Any = priority_class_manifest(name, int(value), priority)
            try:
                await scheduling.create_priority_class(body)
            except ApiException as e:
                if e.status != 409:
                    raise
        self._classes_ready = True

    async def delete_pod(self, name: str, timeout: float = DISCARD_TIMEOUT) -> None:
        from kubernetes_asyncio.client import V1DeleteOptions
        from kubernetes_asyncio.client.exceptions import ApiException

        api = await self._core()
        try:
            await api.delete_namespaced_pod(
                name, self.namespace, body=V1DeleteOptions(grace_period_seconds=1)
            )
        except ApiException as e:
            if e.status != 404:
                raise
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                await api.read_namespaced_pod(name, self.namespace)
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            await asyncio.sleep(POLL_SECONDS)
        raise TimeoutError(f"member pod {name} still there after {timeout:.0f} s")

    # -- WarmBackend -----------------------------------------------------------------------------

    def fingerprint(self, profile: Profile) -> str:
        """The profile's definition and everything else the member pod is made of: a member of
        another fingerprint is stale and recreated."""
        text = repr(
            (
                profile,
                self.image,
                self.pause_image,
                self.image_pull_policy,
                self.sharing,
                sorted(self.priority_classes.items()),
                self.namespace,
                sorted(self.labels.items()),
            )
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def manifest(self, name: str, profile: Profile, placement: Placement) -> dict[str, Any]:
        spec = self.placed_pod(profile, placement).gpu
        return warm_member_pod_manifest(
            name,
            namespace=self.namespace,
            placement=placement,
            limits=spec.limits,
            node_affinity_required=spec.node_affinity_required,
            tolerations=spec.tolerations,
            priority_class_name=spec.priority_class_name,
            image=self.image,
            pause_image=self.pause_image,
            image_pull_policy=self.image_pull_policy,
            labels=self.labels,
        )

    async def start_member(
        self, member_id: str, profile: Profile, placement: Placement
    ) -> KubeWarmMember:
        api = await self._core()
        await self._ensure_priority_classes(api)
        name = member_pod_name(member_id)
        await api.create_namespaced_pod(self.namespace, self.manifest(name, profile, placement))
        return KubeWarmMember(
            self, member_id, profile.slug, self.fingerprint(profile), name, placement.node
        )

    # -- SweepsMembers ---------------------------------------------------------------------------

    async def sweep_members(self, keep: set[str]) -> list[str]:
        """Delete every member pod (by label) whose reservation is not in `keep` (left by a
        previous hub process); the allocation ids they held."""
        api = await self._core()
        listed = await api.list_namespaced_pod(
            self.namespace, label_selector=f"{WARM_MEMBER_LABEL}=true"
        )
        pods = api.api_client.sanitize_for_serialization(listed).get("items") or []
        swept: list[str] = []
        for pod in pods:
            try:
                placement = placement_from_pod(pod)
            except (ValueError, KeyError, json.JSONDecodeError):
                placement = None
            member_id = placement.request.id if placement is not None else ""
            if member_id in keep:
                continue
            name = pod["metadata"]["name"]
            if self.log is not None:
                self.log.info("Warm pool: deleting member pod %s left by a previous hub", name)
            with contextlib.suppress(TimeoutError):
                await self.delete_pod(name)
            if member_id:
                swept.append(member_id)
        return swept
