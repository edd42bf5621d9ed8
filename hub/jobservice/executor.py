"""The executor contract the job service holds backends to: what it may ask of whatever runs an
attempt of a job run (local processes on the embedded default, Kubernetes Jobs on a cluster).

One required interface, as `gpulab.hub.workspaces` is for spawners: the service calls these and
never `hasattr`. It lives on the hub's side because the hub depends on it; the backends implement
it (`gpulab.spawner.local.jobs.LocalJobExecutor`, and the Kubernetes one) and are handed to the
service, so the hub imports no spawner code.

A handle is the executor's own JSON (a process's pid and start time, a Job's name): the service
stores it per attempt (`JobStore.set_handle`) and gives it back after a hub restart, so the
executor finds the attempt again without the hub having been its parent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from gpulab.hub.allocator import Placement
from gpulab.hub.jobs import Event, JobSpec, Run

Handle = Mapping[str, Any]


class JobOutcome(Protocol):
    """How an attempt ended, as the executor saw it."""

    def event(self, at: float) -> Event:
        """The run's event for it: Succeed, Fail (exit code, reason; `platform_failure` when it
        failed before the job's own code started), TimeOut, Cancel or Preempt."""


@runtime_checkable
class JobExecutor(Protocol):
    """Runs attempts of job runs (see the module docstring)."""

    async def start(
        self,
        run: Run,
        spec: JobSpec,
        placement: Placement,
        report: Mapping[str, str] | None = None,
    ) -> Handle:
        """Start the run's current attempt on `placement` (its GPUs, its node) as the job's
        owner; returns its handle once the attempt runs. Raises on a start that failed, having
        left nothing running. `report`: the attempt's GPU report (`gpulab.hub.report_tokens`),
        handed to the job wrapper as privately as its spec (`wrapper_spec(report=...)`), never
        in the job's environment; None: the hub runs no gpulab-metrics."""

    async def wait(self, handle: Handle) -> JobOutcome:
        """Return when the attempt has ended and nothing of it runs any more (its GPU share may be
        given to someone else right after), however it ended; works on a reattached handle."""

    async def cancel(self, handle: Handle) -> None:
        """Stop the attempt (SIGTERM or Job deletion, then force after a grace period); returns
        when nothing of it runs. `wait` then reports it canceled."""

    async def reattach(self, handle: Handle) -> bool:
        """After a hub restart: True while the attempt still runs (wait for it), False when it
        has ended (`wait` still reports how)."""

    async def tail(self, handle: Handle, stream: str, offset: int = 0) -> tuple[bytes, int]:
        """The attempt's `stream` log ("stdout", "stderr") from byte `offset`; the bytes and the
        offset to ask from next."""

    async def outputs(self, handle: Handle) -> list[tuple[str, int]]:
        """The files the run wrote under its output directory: (relative path, size)."""


@runtime_checkable
class RunsJobs(Protocol):
    """A spawner class whose backend runs job attempts: the hub asks `JupyterHub.spawner_class`
    for its executor (the hub imports no spawner code; a spawner class without it runs no jobs,
    and the REST API says so)."""

    @classmethod
    def job_executor(
        cls,
        *,
        runs_dir: str,
        gpu_of: Callable[[str], Any],
        spawner_for: Callable[[str], Awaitable[Any]],
        kernel_start_timeout_seconds: int = 60,
    ) -> JobExecutor:
        """The executor of this backend. `runs_dir`: the hub's folder for attempts' logs and
        records; `gpu_of(uuid)`: the inventory's GPU behind a share; `spawner_for(owner)`: the
        hub user's default server's spawner (her account, her home, her backend settings);
        `kernel_start_timeout_seconds`: how long a notebook's kernel may take to start (the job
        wrapper's `--kernel-start-timeout`, `GPUJobs.kernel_start_timeout_seconds`)."""
