"""The executor contract the cluster service holds backends to: what it may ask of whatever runs
a Dask cluster's scheduler and workers (the owner's processes on the embedded default; the
dask-kubernetes operator's ``DaskCluster`` / ``DaskWorkerGroup`` objects on a cluster).

One required interface, as ``gpulab.hub.jobservice.executor`` is for job attempts: the service
calls these and never ``hasattr``. It lives on the hub's side because the hub depends on it; the
backends implement it (``gpulab.spawner.local.dask.LocalDaskExecutor``,
``gpulab.spawner.kube.dask.KubeDaskExecutor``) and are handed to the service, so the hub imports
no spawner code.

A handle is the executor's own JSON (a process's pid and start time, an object's name): the
service stores it per scheduler and per worker (``ClusterStore.set_handle``) and gives it back
after a hub restart, so the executor finds the process or pod again without having been its
parent.

TLS. Every cluster has credentials of its own (``ClusterTLS``, made by the service): the
scheduler and its workers accept only peers that present them, so other accounts on a machine
(or other pods in a cluster) that reach the scheduler's port cannot connect. The executor writes
them where only the owner's processes read them (0600 files in the owner's state directory; a
Secret in the owner's namespace) and never into argv or the environment of another account.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gpulab.hub.allocator import Placement
from gpulab.hub.dask import Cluster, Worker

Handle = Mapping[str, Any]


@dataclass(frozen=True)
class ClusterTLS:
    """One cluster's mutual-TLS material, PEM text: a self-signed certificate that is its own
    CA, presented by scheduler, workers, the hub's monitor and the owner's client alike. Holding
    it lets one run code in that cluster as its owner: it is given only to the owner (through
    the hub, with a token that manages her clusters) and to the cluster's own processes."""

    cert_pem: str
    key_pem: str


@dataclass(frozen=True)
class SchedulerStarted:
    """A scheduler that accepts connections: its handle, the ``tls://host:port`` address its
    workers and clients connect to, and the URL of its dashboard as the hub reaches it (the
    hub proxies it; nobody else is meant to reach it directly)."""

    handle: Handle
    address: str
    dashboard_url: str


@runtime_checkable
class DaskExecutor(Protocol):
    """Runs clusters' schedulers and workers (see the module docstring)."""

    async def start_scheduler(
        self, cluster: Cluster, placement: Placement, tls: ClusterTLS
    ) -> SchedulerStarted:
        """Start the cluster's scheduler on ``placement`` (no GPU) as its owner; return once it
        accepts TLS connections. Raises on a start that failed, having left nothing running."""

    async def start_worker(
        self,
        cluster: Cluster,
        worker: Worker,
        placement: Placement,
        scheduler_address: str,
        tls: ClusterTLS,
        report: Mapping[str, str] | None = None,
    ) -> Handle:
        """Start worker ``worker.number`` on ``placement`` (its GPU share's environment:
        CUDA_VISIBLE_DEVICES, the GPULAB_* share variables, dask-cuda's worker where it holds a
        GPU) as the owner, named ``worker_name(worker.number)`` so the scheduler's view maps
        back to it; returns its handle once the process or pod exists (joining the scheduler is
        the service's to watch). Raises having left nothing running.

        ``report``: the worker's GPU report (``gpulab.hub.report_tokens``: REPORT_*_ENV and
        the push interval, with a token worth only reporting for this one worker), which its
        preload pushes with. It goes into the worker's environment only, as privately as the
        TLS key: the owner's own process (never argv, never the scheduler) locally, a Secret
        the pod's variables reference on Kubernetes (never a literal in the pod). None: the
        hub runs no gpulab-metrics."""

    async def stop(self, handle: Handle, grace_seconds: float) -> None:
        """Stop a scheduler or worker: SIGTERM (pod deletion), kill after ``grace_seconds``;
        return only when nothing of it runs (its share may be given away right after)."""

    async def running(self, handle: Handle) -> bool:
        """Whether the process or pod of ``handle`` still runs (after a hub restart too)."""

    async def exit_reason(self, handle: Handle) -> str:
        """Why an ended process or pod ended, for people ("exited with status 1", "OOMKilled",
        "node gpu-a100-1 was lost"); "" when unknown."""


@runtime_checkable
class KeepsWarmLaunchers(Protocol):
    """An optional capability: an executor that keeps processes warm between starts (the local
    backend's per-owner fork servers), which the service ends when it closes. Clusters keep
    running; the executor's next start makes new ones."""

    async def close(self) -> None:
        """End the warm processes."""


@runtime_checkable
class CleansUpEndedClusters(Protocol):
    """An optional capability: an executor that keeps files of a cluster outside its processes
    (the local backend: the cluster's TLS key and config, the workers' spill); the service
    calls it once nothing of the cluster runs. (On Kubernetes the objects' owner references
    take such things with the cluster.)"""

    async def cluster_ended(self, cluster: Cluster) -> None:
        """Remove what the cluster's processes no longer need (logs may stay)."""


@runtime_checkable
class RunsDaskClusters(Protocol):
    """A spawner class whose backend runs Dask clusters: the hub asks
    ``JupyterHub.spawner_class`` for its executor (a spawner class without it runs none, and
    the REST API says so with a 501)."""

    @classmethod
    def dask_executor(
        cls,
        *,
        state_dir: str,
        gpu_of: Callable[[str], Any],
        spawner_for: Callable[[str], Awaitable[Any]],
    ) -> DaskExecutor:
        """The executor of this backend. ``state_dir``: the hub's folder for clusters' logs and
        records; ``gpu_of(uuid)``: the inventory's GPU behind a share; ``spawner_for(owner)``:
        the hub user's default server's spawner (her account, her home, her backend settings)."""
