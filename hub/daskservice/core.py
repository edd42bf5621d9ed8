"""The cluster service's shared state: its settings, what it keeps in memory per cluster
(`_Tracked`), and its store calls, each run in a thread against the store's compare-and-set.

Apart from `service.py` so that each step of a cluster's life (admission in `admission.py`,
watching in `watching.py`, stopping in `stopping.py`) is a module of its own, all building on
this one base; `DaskService` puts them together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.dask import Cluster, ClusterState, ClusterStore, Worker, WorkerState, idle_timeout
from gpulab.hub.jobs import share_label
from gpulab.hub.profiles import Profile

from .executor import ClusterTLS, DaskExecutor
from .monitor import SchedulerMonitor

log = logging.getLogger("gpulab.dask")

#: the handle row that keeps a cluster's TLS material (the store's handles are per component:
#: "scheduler", worker names "w<n>", and this). The store is the hub's, 0600 or a database only
#: the hub reaches; a restarted hub (or another hub worker) needs it to reach the scheduler.
TLS_COMPONENT = "tls"
SCHEDULER_COMPONENT = "scheduler"
#: how long `close` waits for its tasks to end once cancelled
CLOSE_TIMEOUT_SECONDS = 15.0
#: how many monitor rounds in a row an adaptive cluster's scheduler must want fewer workers
#: before the hub retires any (distributed's Adaptive waits 3 too)
ADAPTIVE_DOWN_AFTER = 3
#: this many workers of a cluster failing within REPLACEMENT_PAUSE_SECONDS pause replacements
REPLACEMENT_PAUSE_AFTER = 3
REPLACEMENT_PAUSE_SECONDS = 60.0
#: a pending cluster's scheduler waits for this before the first admission pass has run
NOT_YET_CONSIDERED = "pending; the next admission pass places it"


@dataclass
class _Tracked:
    """What the service keeps in memory about one cluster it runs."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: the scheduler's start, workers' starts and retirements in flight
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    starts: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    monitor: SchedulerMonitor | None = None
    watcher: asyncio.Task[None] | None = None
    shutdown: asyncio.Task[None] | None = None
    idle_since: float | None = None
    scheduler_target: int | None = None
    #: consecutive answers of the scheduler that asked for fewer workers than there are: an
    #: adaptive cluster shrinks only after ADAPTIVE_DOWN_AFTER of them, as distributed's own
    #: Adaptive waits, so a gap between two computations does not retire workers holding data
    fewer_wanted: int = 0
    #: why the scheduler of a pending cluster waits
    reason: str = NOT_YET_CONSIDERED
    #: the scheduler's latest tasks (processing, queued, waiting) and the server the cluster came
    #: from (owner, server name): GPU-aware culling spares a server whose clusters have work
    scheduler_tasks: int = 0
    origin: tuple[str, str] | None = None


class DaskServiceCore:
    """The settings, per-cluster memory and store access every step of the service shares."""

    def __init__(
        self,
        store: ClusterStore,
        capacity: GPUCapacity,
        executor: DaskExecutor,
        *,
        make_tls: Callable[[Cluster], ClusterTLS],
        clock: Callable[[], float] = time.time,
        admission_interval_seconds: float = 5.0,
        monitor_interval_seconds: float = 2.0,
        default_idle_timeout_seconds: int = 3600,
        max_idle_timeout_seconds: int = 7 * 24 * 3600,
        scheduler_cpu_milli: int = 1000,
        scheduler_memory_mib: int = 1024,
        affinity_group_of: Callable[[Cluster], str | None] = lambda cluster: None,
        notebook_of: Callable[[Cluster], str | None] = lambda cluster: None,
        report_for: Callable[[str], Mapping[str, str] | None] | None = None,
    ) -> None:
        self.store, self.capacity, self.executor, self.clock = store, capacity, executor, clock
        self.make_tls = make_tls
        self.admission_interval_seconds = admission_interval_seconds
        self.monitor_interval_seconds = monitor_interval_seconds
        self.default_idle_timeout_seconds = default_idle_timeout_seconds
        self.max_idle_timeout_seconds = max_idle_timeout_seconds
        self.scheduler_cpu_milli = scheduler_cpu_milli
        self.scheduler_memory_mib = scheduler_memory_mib
        self.affinity_group_of = affinity_group_of
        #: the allocation id of the server a cluster came from (its workers prefer its node)
        self.notebook_of = notebook_of
        #: a worker's GPU report for its allocation id (the hub's `ReportTokens.issue`: a token
        #: of its own, revoked when the share is given back); None: no reports
        self.report_for = report_for
        self._tracked: dict[int, _Tracked] = {}
        self._admitting = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._release_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._preempting: dict[tuple[int, int], str] = {}

    # -- helpers -------------------------------------------------------------------------------

    def _track(self, cluster_id: int) -> _Tracked:
        tracked = self._tracked.get(cluster_id)
        if tracked is None:
            tracked = self._tracked[cluster_id] = _Tracked()
        return tracked

    def _spawn(self, coro: Awaitable[Any], tracked: _Tracked | None = None) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        owner = tracked.tasks if tracked is not None else self._background
        owner.add(task)
        task.add_done_callback(owner.discard)
        task.add_done_callback(_log_failure)
        return task

    async def _get(self, cluster_id: int) -> Cluster:
        return await asyncio.to_thread(self.store.get, cluster_id)

    async def _workers(
        self, cluster_id: int, states: Iterable[WorkerState] | None = None
    ) -> list[Worker]:
        wanted = None if states is None else set(states)
        return await asyncio.to_thread(self.store.workers, cluster_id, states=wanted)

    async def _transition(self, cluster: Cluster, event: Any) -> Cluster | None:
        return await asyncio.to_thread(
            self.store.transition,
            cluster.id,
            event,
            expected_state=cluster.state,
            expected_version=cluster.version,
        )

    async def _transition_worker(self, worker: Worker, event: Any) -> Worker | None:
        return await asyncio.to_thread(
            self.store.transition_worker,
            worker.cluster_id,
            worker.number,
            event,
            expected_state=worker.state,
            expected_version=worker.version,
        )

    async def _handle(self, cluster_id: int, component: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.store.handle, cluster_id, component)

    async def tls_of(self, cluster_id: int) -> ClusterTLS | None:
        """The cluster's TLS material (None before its scheduler was placed)."""
        raw = await self._handle(cluster_id, TLS_COMPONENT)
        return None if raw is None else ClusterTLS(raw["cert_pem"], raw["key_pem"])

    def profile_of(self, cluster: Cluster) -> Profile | None:
        return self.capacity.profile(cluster.spec.profile)

    def idle_timeout_of(self, cluster: Cluster) -> int:
        """The idle timeout that applies to the cluster (its own, capped by the hub's)."""
        return idle_timeout(
            cluster, self.default_idle_timeout_seconds, self.max_idle_timeout_seconds
        )

    def share_of(self, cluster: Cluster, worker: Worker | None = None) -> str:
        """'1/4 GPU': a worker's share (its placement's, else its profile's)."""
        if worker is not None and worker.placement is not None and worker.placement.gpus:
            gpus = worker.placement.gpus
            if all(s.milli >= 1000 for s in gpus):
                return share_label(num_gpu=len(gpus))
            return share_label(gpu_milli=sum(s.milli for s in gpus))
        profile = self.profile_of(cluster)
        if profile is None:
            return cluster.spec.profile
        return share_label(profile.num_gpu, profile.gpu_milli)

    def scheduler_reason(self, cluster: Cluster) -> str:
        """Why a pending cluster's scheduler waits (its stored reason otherwise)."""
        if cluster.state is ClusterState.PENDING:
            return self._track(cluster.id).reason
        return cluster.reason

    def waiting_reason(self, cluster: Cluster, workers: Iterable[Worker]) -> str | None:
        """Why pending workers wait (the allocator's sentence), None when none waits."""
        for worker in workers:
            if worker.state is WorkerState.PENDING:
                if worker.reason:
                    return worker.reason
                if cluster.state is not ClusterState.RUNNING:
                    return "waiting for the scheduler to start"
                return "pending; the next admission pass places it"
        return None

    async def _stop_component(self, cluster_id: int, component: str, grace: float) -> None:
        handle = await self._handle(cluster_id, component)
        if handle is not None:
            await self.executor.stop(handle, max(0.0, grace))

    def wake(self) -> None:
        """Run an admission pass soon."""
        self._wake.set()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("Dask cluster service task failed", exc_info=task.exception())


__all__ = ["NOT_YET_CONSIDERED", "SCHEDULER_COMPONENT", "TLS_COMPONENT", "DaskServiceCore"]
