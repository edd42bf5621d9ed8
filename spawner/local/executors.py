"""The job and Dask executors of gpulab's local spawners, which the hub's job and Dask services
make from the spawner's class (`RunsJobs`, `RunsDaskClusters`).

`LocalExecutorsMixin` is a part of `GPULocalSpawnerMixin` (`gpulab.spawner.local.spawner`), apart
because no server runs through it: the executors are made once, before any spawner exists, and
run a job's attempts (`gpulab.spawner.local.jobs`) and a cluster's scheduler and workers
(`gpulab.spawner.local.dask`) as their owner's account, asking the owner's spawner only for that
account and her default server's home.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpulab.spawner.local.accounts import SystemAccount


class LocalExecutorsMixin:
    """The executors of the embedded default: jobs and Dask clusters as their owner's account."""

    @classmethod
    def job_executor(
        cls,
        *,
        runs_dir: str,
        gpu_of: Callable[[str], Any],
        spawner_for: Callable[[str], Awaitable[Any]],
        kernel_start_timeout_seconds: int = 60,
    ) -> Any:
        """The job executor of the embedded default (`gpulab.hub.jobservice.RunsJobs`): a job's
        attempts run as its owner's account, as her servers do, with paths relative to her
        default server's home (what JupyterLab shows her). Never as the hub's account: where
        servers share it (server_accounts = 'hub') jobs are refused, since nothing would keep
        one user's job from another's files."""
        from gpulab.spawner.local.jobs import JobRunnerError, LocalJobExecutor, LocalJobRunner

        workspace_for = _owner_workspace(spawner_for, JobRunnerError, "jobs")
        return LocalJobExecutor(
            LocalJobRunner(runs_dir, kernel_start_timeout_seconds=kernel_start_timeout_seconds),
            workspace_for,
            gpu_of,
            inventory_of=_inventory_of,
        )

    @classmethod
    def dask_executor(
        cls,
        *,
        state_dir: str,
        gpu_of: Callable[[str], Any],
        spawner_for: Callable[[str], Awaitable[Any]],
    ) -> Any:
        """The Dask executor of the embedded default (`gpulab.hub.daskservice.RunsDaskClusters`):
        a cluster's scheduler and workers run as its owner's account, as her servers and jobs do.
        Never as the hub's account: where servers share it (server_accounts = 'hub') clusters
        are refused, since a cluster runs any code its clients send, with the hub's files at
        hand."""
        from gpulab.spawner.local.dask import DaskExecutorError, LocalDaskExecutor

        workspace_for = _owner_workspace(spawner_for, DaskExecutorError, "Dask clusters")
        return LocalDaskExecutor(state_dir, workspace_for, gpu_of, inventory_of=_inventory_of)


def _inventory_of(node: str) -> str:
    """How `node` knows its GPUs, from the hub's capacity (made before its executors: the
    singleton its spawners share)."""
    from gpulab.hub.capacity import GPUCapacity
    from gpulab.spawner.gpu_mixin import node_inventory

    return node_inventory(GPUCapacity.instance().inventory, node)


def _owner_workspace(
    spawner_for: Callable[[str], Awaitable[Any]], error: type[Exception], what: str
) -> Callable[[str], Awaitable[tuple[SystemAccount, str]]]:
    """The owner's system account (made where needed, as for her servers) and her default
    server's home (what JupyterLab shows her); ``error`` where servers share the hub's own
    account, since nothing would keep one user's processes from another's files."""

    async def workspace_for(owner: str) -> tuple[SystemAccount, str]:
        spawner = await spawner_for(owner)
        if spawner.server_runs_as_hub():
            raise error(
                "servers share the hub's own account on this hub (server_accounts = 'hub'): "
                f"{what} need an account per user"
            )
        account = await spawner.workspace_account(create=True)
        return account, str(spawner.workspace_home_dir())

    return workspace_for
