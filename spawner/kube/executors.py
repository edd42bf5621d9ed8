"""The job and Dask executors of GPUKubeSpawner, which the hub's job and Dask services make from
the spawner's class (`RunsJobs`, `RunsDaskClusters`), and what a Dask cluster needs of its owner's
spawner.

`KubeExecutorsMixin` is a part of `GPUKubeSpawner` (`gpulab.spawner.kube.spawner`), apart because
no server runs through it: the executors are made once, before any spawner exists, and make a
job's attempts (`gpulab.spawner.kube.jobs`) and a cluster's objects (`gpulab.spawner.kube.dask`)
in the owner's namespace, asking her spawner for her identity, home claim, hardening and
NetworkPolicy rules, as her servers have them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class KubeExecutorsMixin:
    """The executors of the Kubernetes backend: jobs as `batch/v1` Jobs, Dask clusters as the
    dask-kubernetes operator's objects."""

    @classmethod
    def job_executor(
        cls,
        *,
        runs_dir: str,
        gpu_of: Callable[[str], Any],
        spawner_for: Callable[[str], Awaitable[Any]],
        kernel_start_timeout_seconds: int = 60,
    ) -> Any:
        """The job executor of this backend (`gpulab.hub.jobservice.RunsJobs`): each attempt a
        `batch/v1` Job in the owner's namespace, with her servers' identity, home claim and
        NetworkPolicy rules (`gpulab.spawner.kube.jobs`)."""
        from gpulab.spawner.kube.jobs import KubeJobError, KubeJobExecutor

        async def kube_spawner_for(owner: str) -> Any:
            spawner = await spawner_for(owner)
            if spawner.profile_list or not spawner.workspaces_enabled:
                raise KubeJobError(
                    "GPU jobs on Kubernetes need gpulab's profiles and a home claim per user "
                    "(GPUKubeSpawner.checkpoints, no profile_list): a job reads and writes the "
                    "home its owner's server mounts"
                )
            return spawner

        # gpu_of is not needed: the spawner maps a placement's GPUs as for her servers
        return KubeJobExecutor(
            runs_dir=runs_dir,
            spawner_for=kube_spawner_for,
            kernel_start_timeout_seconds=kernel_start_timeout_seconds,
        )

    # -- Dask clusters ---------------------------------------------------------------------------

    async def dask_target(self) -> Any:
        """What the Dask executor needs of this user's backend (`gpulab.spawner.kube.dask`):
        the hub's client, her namespace, image, uid and hardening (as her servers' and jobs'),
        the hub's addresses for the clusters' NetworkPolicy, her profiles and the pod side of a
        placement (as a job's)."""
        from gpulab.spawner.kube.dask import KubeDaskTarget
        from gpulab.spawner.kube.dask_settings import KubeDaskSettings

        await self.gpu_state()  # the cluster view the placed pods' devices come from

        async def resolved(value: Any) -> Any:
            if callable(value):
                value = value(self)
                if asyncio.iscoroutine(value):
                    value = await value
            return value

        settings = KubeDaskSettings(
            namespace=self.namespace,
            image=self.image,
            python=self.job_python,
            uid=await resolved(self.uid),
            gid=await resolved(self.gid),
            fs_gid=await resolved(self.fs_gid),
            run_as_non_root=self.run_as_non_root,
            seccomp=self.seccomp_profile,
            drop_capabilities=tuple(self.drop_capabilities),
            termination_grace_seconds=int(self.delete_grace_period),
            image_pull_policy=self.image_pull_policy or None,
            labels=dict(self.common_labels),
            hub_selector=dict(self.network_policy_hub_labels),
            hub_cidrs=tuple(self.network_policy_hub_cidrs),
            hub_push_ports=tuple(self._push_ports()),
            allow_internet=self.network_policy_allow_internet,
            cloud_metadata_ip=self.cloud_metadata_ip,
        )
        classes = {p: str(v[0]) for p, v in self.priority_classes.items()}
        return KubeDaskTarget(
            api_client=self.api.api_client,
            settings=settings,
            profile=self.gpu_capacity.profile,
            placed_pod=self.placed_job_pod,
            priority_class=lambda priority: classes.get(priority, ""),
            node_failure_seconds=float(self.node_failure_seconds),
            start_timeout=float(self.start_timeout),
        )

    @classmethod
    def dask_executor(
        cls,
        *,
        state_dir: str,
        gpu_of: Callable[[str], Any],
        spawner_for: Callable[[str], Awaitable[Any]],
    ) -> Any:
        """The Dask executor of this backend (`gpulab.hub.daskservice.RunsDaskClusters`): each
        cluster a DaskCluster and one DaskWorkerGroup per worker in the owner's namespace, made
        into pods by the dask-kubernetes operator (`gpulab.spawner.kube.dask`)."""
        from gpulab.spawner.kube.dask import KubeDaskError, KubeDaskExecutor

        async def target_for(owner: str) -> Any:
            spawner = await spawner_for(owner)
            if spawner.profile_list:
                raise KubeDaskError(
                    "Dask clusters on Kubernetes need gpulab's profiles (no profile_list): each "
                    "worker is admitted on a profile's share"
                )
            return await spawner.dask_target()

        # state_dir and gpu_of are not needed: the objects live in the cluster, and the spawner
        # maps a placement's GPUs as for her servers
        return KubeDaskExecutor(target_for=target_for)
