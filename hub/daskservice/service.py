"""The cluster service: Dask clusters owned by the hub, in the hub process (decision record 0003).

Why in the hub: every worker is admitted by the one allocator a hub holds (`GPUCapacity`), under
the same quotas, headroom and priorities as servers and jobs; a second process would be a second
owner of allocations. What must outlive the hub does: clusters, workers and the executors'
handles are in the cluster store, schedulers and workers are processes or pods that are no
children of the hub, and `recover()` finds them again.

A cluster's life here, with the store's compare-and-set at every step:

    create   checks the profile (exists, visible to the owner, fits the machine) and the initial
             size against the owner's quota (refused whole, 403 naming the limit and the most
             workers that fit), stores the cluster with its workers pending, wakes admission;
    admit    each pass, per live cluster: the scheduler is placed (`scheduler_request`: CPU and
             memory, no GPU) and started; once it answers, the cluster is scaled to its target
             (`plan_scale`) and every pending worker is placed on its own (`worker_request`)
             and started, or waits with the allocator's reason. Passes run when woken (a
             create, a scale, a share given back anywhere in the hub) and every
             `admission_interval_seconds`;
    watch    a monitor per running cluster talks to its scheduler over the cluster's TLS
             (`SchedulerMonitor`): workers that joined become running, workers whose process
             ended fail (their share is given back; the target asks for a replacement), the
             adaptive target is read, and an idle cluster (no tasks, no client) stops after its
             idle timeout;
    scale    by hand (refused whole beyond quota) or adaptively (the scheduler's target, within
             quota); surplus workers retire in `retire_order`, each keeping its share until its
             process is gone;
    stop     every worker SIGTERM, killed at 20 s, then the scheduler; each allocation released
             once what held it is gone, nothing left at 60 s (`stop_schedule`);
    recover  after a hub restart: running clusters are watched again, their ended workers
             failed, stopping clusters finish stopping, a scheduler caught starting is stopped.

Each step is a module of its own that `DaskService` builds on, one base after the other: `core`
(the settings, per-cluster memory and store calls), `stopping`, `watching` and `admission` (with
retiring); this module adds what an owner asks for, preemption, recovery and the loop.

Pure of JupyterHub (the REST handlers and `GPUDask` wire it into a hub), as the job service is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.capacity_catalog import ProfileUnavailable
from gpulab.hub.dask import (
    HOLDING_WORKER_STATES,
    WORKER_STOP_GRACE_SECONDS,
    Adapt,
    Cluster,
    ClusterNotFound,
    ClusterSpec,
    ClusterState,
    IllegalTransition,
    Preempted,
    Scale,
    SetKeepAlive,
    WorkerFailed,
    WorkerState,
    parse_allocation_id,
    worker_allocation_id,
)
from gpulab.hub.hub_service import admission_loop
from gpulab.hub.profiles import Profile

from .admission import DaskAdmission
from .core import CLOSE_TIMEOUT_SECONDS, SCHEDULER_COMPONENT
from .executor import KeepsWarmLaunchers

log = logging.getLogger("gpulab.dask")


class DaskRefused(Exception):
    """A request that cannot be done as asked: ``status`` is the HTTP status (400 a wrong
    request, 403 beyond the owner's rights or quota, 409 a state that does not allow it),
    ``field`` what to change."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message = status, field, message


class DaskService(DaskAdmission):
    """See the module docstring. One per hub; `start()` recovers and runs admission."""

    # -- create --------------------------------------------------------------------------------

    async def create(self, spec: ClusterSpec, *, is_admin: bool = False) -> Cluster:
        """Store a new cluster of `spec` (its owner, groups and server are the hub's record of
        the caller) and start admitting it. `DaskRefused` for a profile it may not use or an
        initial size beyond its quota; `ClusterNameTaken` for a live name."""
        profile = self._check_profile(spec, is_admin)
        refusal = self._quota_refusal(spec, profile, spec.n_workers, held_milli=0)
        if refusal is not None:
            raise DaskRefused(403, "n_workers", refusal)
        cluster = await asyncio.to_thread(self.store.create, spec)
        if spec.n_workers:
            await asyncio.to_thread(self.store.add_workers, cluster.id, spec.n_workers)
        self._track(cluster.id)
        log.info(
            "Dask cluster %d (%r) of %s: %d workers of %s",
            cluster.id,
            spec.name,
            spec.owner,
            spec.n_workers,
            spec.profile,
        )
        self.wake()
        return cluster

    def _check_profile(self, spec: ClusterSpec, is_admin: bool) -> Profile:
        try:
            profile = self.capacity.workload_profile(spec.profile, spec.groups, is_admin)
        except ProfileUnavailable as e:
            raise DaskRefused(400, "profile", str(e)) from None
        return profile

    # -- scale, keep alive ---------------------------------------------------------------------

    async def scale(self, cluster_id: int, n: int) -> Cluster:
        """Scale by hand to `n` workers; refused whole (403, nothing changed) when `n` workers
        would not fit the owner's quota."""
        async with self._track(cluster_id).lock:
            cluster = await self._live(cluster_id)
            profile = self.profile_of(cluster)
            if profile is not None:
                workers = await self._workers(cluster_id)
                refusal = self._quota_refusal(
                    cluster.spec, profile, n, held_milli=self._held_milli(workers)
                )
                if refusal is not None:
                    raise DaskRefused(403, "n_workers", refusal)
            changed = await self._change(cluster, Scale(self.clock(), n))
        self.wake()
        return changed

    async def adapt(self, cluster_id: int, minimum: int, maximum: int) -> Cluster:
        """Scale adaptively between `minimum` and `maximum` (the hub follows the scheduler's
        target within quota); 403 when even `minimum` workers exceed the quota."""
        async with self._track(cluster_id).lock:
            cluster = await self._live(cluster_id)
            profile = self.profile_of(cluster)
            if profile is not None:
                workers = await self._workers(cluster_id)
                refusal = self._quota_refusal(
                    cluster.spec, profile, minimum, held_milli=self._held_milli(workers)
                )
                if refusal is not None:
                    raise DaskRefused(403, "minimum", refusal)
            changed = await self._change(cluster, Adapt(self.clock(), minimum, maximum))
        self.wake()
        return changed

    async def set_keep_alive(self, cluster_id: int, keep_alive: bool) -> Cluster:
        async with self._track(cluster_id).lock:
            cluster = await self._live(cluster_id)
            return await self._change(cluster, SetKeepAlive(self.clock(), keep_alive))

    async def _live(self, cluster_id: int) -> Cluster:
        cluster = await self._get(cluster_id)
        if not cluster.is_live:
            raise DaskRefused(
                409, "state", f"cluster {cluster.name!r} is {cluster.state.value}: it cannot change"
            )
        return cluster

    async def _change(self, cluster: Cluster, event: Any) -> Cluster:
        # an adaptive or admission step may have bumped the version: read again and retry
        for _ in range(10):
            changed = await self._transition(cluster, event)
            if changed is not None:
                return changed
            cluster = await self._live(cluster.id)
        raise RuntimeError(f"Dask cluster {cluster.id} kept changing")

    # -- preemption ----------------------------------------------------------------------------

    def tasks_of(self, owner: str, server: str) -> int:
        """Tasks not done (processing, queued, waiting) in the running clusters `owner` made
        from `server`, as their schedulers last said (every `monitor_interval_seconds`)."""
        return sum(t.scheduler_tasks for t in self._tracked.values() if t.origin == (owner, server))

    def owns_allocation(self, allocation: str) -> bool:
        """Whether `allocation` is a Dask worker's (schedulers are never preempted)."""
        parsed = parse_allocation_id(allocation)
        return parsed is not None and parsed.worker is not None

    async def preempt(self, placement: Placement, reason: str) -> None:
        """The capacity's evictor for preemptible workers: stop the worker for on-demand work
        (its share is already the newcomer's) and return once nothing of it runs; the cluster's
        target then asks for a replacement, which waits for a place like any worker."""
        parsed = parse_allocation_id(placement.request.id)
        if parsed is None or parsed.worker is None:
            return
        try:
            worker = await asyncio.to_thread(
                self.store.get_worker, parsed.cluster_id, parsed.worker
            )
        except ClusterNotFound:
            return
        if worker.state not in HOLDING_WORKER_STATES:
            return
        log.warning(
            "Dask cluster %d: worker %s preempted: %s", worker.cluster_id, worker.name, reason
        )
        tracked = self._track(worker.cluster_id)
        key = (worker.cluster_id, worker.number)
        # the monitor may see the process gone first: it then records the preemption too
        self._preempting[key] = reason
        try:
            start = tracked.starts.get(worker.name)
            if start is not None:
                await asyncio.wait([start])
            await self._stop_component(worker.cluster_id, worker.name, WORKER_STOP_GRACE_SECONDS)
            for _ in range(10):
                current = await asyncio.to_thread(
                    self.store.get_worker, worker.cluster_id, worker.number
                )
                if current.state not in HOLDING_WORKER_STATES:
                    break
                event = Preempted(self.clock(), reason)
                if await self._transition_worker(current, event) is not None:
                    break
        finally:
            self._preempting.pop(key, None)
        self.wake()

    # -- recovery and the loop -----------------------------------------------------------------

    async def recover(self) -> None:
        """After a hub restart (see the module docstring)."""
        clusters = await asyncio.to_thread(
            self.store.list_clusters,
            states={ClusterState.STARTING, ClusterState.RUNNING, ClusterState.STOPPING},
        )
        for cluster in clusters:
            tracked = self._track(cluster.id)
            if cluster.state is ClusterState.STOPPING:
                tracked.shutdown = self._spawn(self._shutdown(cluster.id, tracked))
                continue
            if cluster.state is ClusterState.STARTING:
                reason = "the hub restarted while its scheduler started"
                self._spawn(self.stop(cluster.id, reason, failed=True))
                continue
            handle = await self._handle(cluster.id, SCHEDULER_COMPONENT)
            tls = await self.tls_of(cluster.id)
            if handle is None or tls is None or not await self.executor.running(handle):
                why = await self.executor.exit_reason(handle) if handle else ""
                reason = f"the scheduler ended while the hub was away{': ' + why if why else ''}"
                self._spawn(self.stop(cluster.id, reason, failed=True))
                continue
            for worker in await self._workers(cluster.id, HOLDING_WORKER_STATES):
                whandle = await self._handle(cluster.id, worker.name)
                if worker.state is WorkerState.RETIRING:
                    self._spawn(
                        self._finish_retiring(cluster, worker, tracked, ask_scheduler=False),
                        tracked,
                    )
                elif whandle is None:
                    await self._transition_worker(
                        worker, WorkerFailed(self.clock(), "the hub restarted before it started")
                    )
                    await self.capacity.release(
                        worker_allocation_id(cluster.owner, cluster.id, worker.number)
                    )
                elif not await self.executor.running(whandle):
                    await self._worker_ended(cluster, worker, whandle)
            log.info("Dask cluster %d: running after the hub restart", cluster.id)
            self._watch(cluster, tls, tracked)

    def live_allocation_ids(self) -> set[str]:
        """The allocations clusters hold now (blocking: a store read)."""
        return self.store.live_allocation_ids()

    async def start(self) -> None:
        """Recover, then admit whenever woken and every `admission_interval_seconds`."""
        await self.recover()
        self.capacity.add_evictor(self.owns_allocation, self.preempt)
        self._loop_task = asyncio.ensure_future(self._admission_loop())
        self._release_task = asyncio.ensure_future(self._wake_on_release())

    async def _wake_on_release(self) -> None:
        # any share given back (a server's, a job's, a worker's) may let a pending worker in
        while True:
            await self.capacity.wait_for_release(timeout=3600)
            self.wake()

    async def _admission_loop(self) -> None:
        await admission_loop(self.admit, self._wake, self.admission_interval_seconds, log, "Dask")

    async def close(self) -> None:
        """Stop admitting and watching (clusters keep running: a restarted hub recovers them)."""
        self.capacity.remove_evictor(self.preempt)
        tasks = [t for t in (self._loop_task, self._release_task) if t is not None]
        for tracked in self._tracked.values():
            if tracked.watcher is not None:
                tasks.append(tracked.watcher)
        for task in tasks:
            task.cancel()
        # bounded too: a task stuck in a call that ignores cancellation must not hold the hub's
        # shutdown (it ends with the process)
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_SECONDS)
        for tracked in self._tracked.values():
            if tracked.monitor is not None:
                with contextlib.suppress(Exception):
                    await tracked.monitor.close()
        if isinstance(self.executor, KeepsWarmLaunchers):
            await self.executor.close()
        self._loop_task = self._release_task = None


__all__ = ["DaskRefused", "DaskService", "IllegalTransition"]
