"""The warm-pool side of GPUKubeSpawner: its pool's members, and a server that takes one's place.

`KubeWarmStartMixin` is a part of `GPUKubeSpawner` (`gpulab.spawner.kube.spawner`), apart because
a warm start is a path of its own through a start, with the hub's pool service
(`gpulab.hub.warmpoolservice`) and the members' placeholder pods (`gpulab.spawner.kube.warm_pool`)
on its other side: a start claims a ready member's reservation and deletes its pod, so that the
server's pod takes its node and devices; without one it is placed cold. It relies on
`GPUSpawnerMixin.claim_warm_member` and on KubeSpawner's settings.
"""

from __future__ import annotations

from typing import Any

from kubespawner import KubeSpawner

from gpulab.hub.allocator import Placement
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.profiles import Profile
from gpulab.spawner.kube.gpu_resources import PlacedPod
from gpulab.spawner.kube.placed_pods import placed_pod_on
from gpulab.spawner.kube.state import ensure_kube_state


class KubeWarmStartMixin:
    """Warm capacity of the Kubernetes backend (`KeepsWarmServers`) and a start served by it."""

    @classmethod
    def warm_pool_backend(cls, *, config: Any, log: Any) -> Any:
        """Warm capacity (`KeepsWarmServers`): each member a placeholder pod holding its
        reservation on the node a server of its profile would run on, made before any spawner
        exists, so the settings it needs are read from `config` as traitlets resolves them for
        this class (a subclass's section over its parents')."""
        from gpulab.spawner.kube.warm_pool import KubeWarmBackend

        def configured(name: str) -> Any:
            return cls.class_setting(config, name)

        capacity = GPUCapacity.instance(config=config, log=log)
        sharing = str(configured("gpu_sharing"))
        classes = {p: (str(v[0]), int(v[1])) for p, v in configured("priority_classes").items()}

        def placed(profile: Profile, placement: Placement) -> PlacedPod:
            return placed_pod_on(
                capacity,
                profile,
                placement,
                sharing=sharing,
                priority="preemptible",
                priority_classes={p: v[0] for p, v in classes.items()},
            )

        return KubeWarmBackend(
            # KubeSpawner's default: the hub pod's own namespace, else "default"
            namespace=str(configured("namespace") or KubeSpawner._namespace_default(None)),
            image=str(configured("image")),
            sharing=sharing,
            priority_classes=classes,
            placed_pod=placed,
            ensure_state=lambda: ensure_kube_state(capacity, sharing=sharing),
            image_pull_policy=configured("image_pull_policy") or None,
            log=log,
        )

    async def _claim_warm(self, profile: Profile) -> Placement | None:
        """A ready pool member's reservation, handed over to this server's request (her quota
        and budget checked) with the member pod deleted, so her pod takes its node and devices;
        None: start cold (a member that could not be handed over is discarded)."""
        if self.profile_list:
            return None
        member = await self.claim_warm_member(profile)
        if member is None:
            return None
        placement = self.gpulab_placement
        assert placement is not None
        try:
            await member.discard()
        except Exception as e:  # her pod waits for the devices until the member pod is gone
            self.log.warning(
                "Warm member %s's pod could not be deleted for %s: %s",
                member.id,
                self.allocation_id,
                e,
            )
        self.log.info(
            "GPU allocation %s (profile %s) served warm by %s on %s",
            self.allocation_id,
            profile.slug,
            member.id,
            placement.node,
        )
        return placement
