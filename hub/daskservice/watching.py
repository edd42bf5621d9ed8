"""Watching a running cluster: a monitor asks its scheduler every `monitor_interval_seconds`;
workers that joined become running, workers whose process ended fail (or were preempted), the
adaptive target is read, and an idle cluster stops.

Apart from admission, which starts the watch once a scheduler answers, as recovery does again
after a hub restart.
"""

from __future__ import annotations

import asyncio
import logging

from gpulab.hub.dask import (
    HOLDING_WORKER_STATES,
    Activity,
    Cluster,
    ClusterState,
    Joined,
    Preempted,
    Worker,
    WorkerFailed,
    WorkerState,
    active,
    idle_expired,
    idle_stop_reason,
    next_idle_since,
    worker_allocation_id,
)

from .core import ADAPTIVE_DOWN_AFTER, SCHEDULER_COMPONENT, _log_failure, _Tracked
from .executor import ClusterTLS, Handle
from .monitor import SchedulerMonitor, SchedulerView
from .stopping import DaskStopping

log = logging.getLogger("gpulab.dask")


class DaskWatching(DaskStopping):
    """One watcher task per running cluster, and what it does with the scheduler's answers."""

    # -- watching ------------------------------------------------------------------------------

    def _watch(self, cluster: Cluster, tls: ClusterTLS, tracked: _Tracked) -> None:
        tracked.monitor = SchedulerMonitor(cluster.scheduler_address, tls)
        tracked.idle_since = None
        tracked.watcher = asyncio.ensure_future(self._watch_cluster(cluster.id, tracked))
        tracked.watcher.add_done_callback(_log_failure)

    async def _watch_cluster(self, cluster_id: int, tracked: _Tracked) -> None:
        failures = 0
        while True:
            cluster = await self._get(cluster_id)
            if cluster.state is not ClusterState.RUNNING or tracked.monitor is None:
                tracked.scheduler_tasks = 0
                return
            try:
                view = await tracked.monitor.view()
                failures = 0
            except Exception as e:
                failures += 1
                handle = await self._handle(cluster_id, SCHEDULER_COMPONENT)
                if handle is None or not await self.executor.running(handle):
                    why = await self.executor.exit_reason(handle) if handle else ""
                    reason = f"the scheduler ended{': ' + why if why else ''}"
                    self._spawn(self.stop(cluster_id, reason, failed=True))
                    tracked.scheduler_tasks = 0
                    return
                if failures in (3, 30):
                    log.warning("Dask cluster %d: the scheduler does not answer: %s", cluster_id, e)
            else:
                await self._observe(cluster, view, tracked)
            await asyncio.sleep(self.monitor_interval_seconds)

    async def _observe(self, cluster: Cluster, view: SchedulerView, tracked: _Tracked) -> None:
        workers = await self._workers(cluster.id, HOLDING_WORKER_STATES)
        for worker in workers:
            if worker.name in view.workers:
                if worker.state is WorkerState.ADMITTED:
                    await self._transition_worker(worker, Joined(self.clock()))
                continue
            if worker.state is WorkerState.RETIRING or worker.name in tracked.starts:
                continue
            handle = await self._handle(cluster.id, worker.name)
            if handle is not None and not await self.executor.running(handle):
                await self._worker_ended(cluster, worker, handle)
        now = self.clock()
        tracked.scheduler_tasks, tracked.origin = view.tasks, (cluster.owner, cluster.spec.server)
        tracked.idle_since = next_idle_since(
            tracked.idle_since, Activity(now, view.tasks, view.clients)
        )
        timeout = self.idle_timeout_of(cluster)
        if idle_expired(cluster, tracked.idle_since, now, timeout):
            log.info("Dask cluster %d idle for %d s: stopping it", cluster.id, timeout)
            self._spawn(self.stop(cluster.id, idle_stop_reason(timeout)))
            return
        if cluster.adaptive and tracked.monitor is not None:
            try:
                target = await tracked.monitor.adaptive_target()
                current = len(active(await self._workers(cluster.id)))
                tracked.fewer_wanted = tracked.fewer_wanted + 1 if target < current else 0
                if target != tracked.scheduler_target or (
                    tracked.fewer_wanted == ADAPTIVE_DOWN_AFTER
                ):
                    tracked.scheduler_target = target
                    self.wake()
            except Exception as e:  # the next round asks again
                log.warning("Dask cluster %d: no adaptive target: %s", cluster.id, e)

    async def _worker_ended(self, cluster: Cluster, worker: Worker, handle: Handle) -> None:
        preempted = self._preempting.get((cluster.id, worker.number))
        why = await self.executor.exit_reason(handle)
        event: WorkerFailed | Preempted = WorkerFailed(
            self.clock(), f"ended{': ' + why if why else ''}"
        )
        if preempted is not None:  # stopped for on-demand work: that is why it ended
            event = Preempted(self.clock(), preempted)
        failed = await self._transition_worker(worker, event)
        if failed is not None:
            log.warning("Dask cluster %d: worker %s ended: %s", cluster.id, worker.name, why)
            await self.capacity.release(
                worker_allocation_id(cluster.owner, cluster.id, worker.number)
            )
            self.wake()  # the target asks for a replacement
