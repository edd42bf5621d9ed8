"""Stopping a cluster: every worker retired and stopped (killed at its deadline), then the
scheduler, each share given back once what held it is gone (`stop_schedule`); and stopping the
clusters of a server that stopped.

Apart from admission and watching, which both end a cluster through `stop`, so they build on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gpulab.hub.dask import (
    HOLDING_WORKER_STATES,
    LIVE_CLUSTER_STATES,
    SCHEDULER_STOP_GRACE_SECONDS,
    Cluster,
    ClusterState,
    Exited,
    Retire,
    Stop,
    Stopped,
    Worker,
    WorkerState,
    clusters_to_stop_with_server,
    scheduler_allocation_id,
    server_stop_reason,
    stop_schedule,
    worker_allocation_id,
)

from .core import SCHEDULER_COMPONENT, DaskServiceCore, _Tracked
from .executor import CleansUpEndedClusters

log = logging.getLogger("gpulab.dask")


class DaskStopping(DaskServiceCore):
    """`stop` and what it runs; the watcher and admission stop clusters through it."""

    # -- stopping ------------------------------------------------------------------------------

    async def stop(
        self, cluster_id: int, reason: str = "stopped by its owner", failed: bool = False
    ) -> Cluster:
        """Stop the cluster; return once nothing of it runs and its shares are free. A cluster
        that ended is returned as it is."""
        tracked = self._track(cluster_id)
        for _ in range(10):
            cluster = await self._get(cluster_id)
            if cluster.state in (ClusterState.STOPPED, ClusterState.FAILED):
                return cluster
            if cluster.state is ClusterState.STOPPING:
                break
            if await self._transition(cluster, Stop(self.clock(), reason, failed)) is not None:
                log.info("Dask cluster %d stopping: %s", cluster_id, reason)
                break
        else:
            raise RuntimeError(f"Dask cluster {cluster_id} kept changing while it was stopped")
        if tracked.shutdown is None:
            tracked.shutdown = asyncio.ensure_future(self._shutdown(cluster_id, tracked))
        await asyncio.shield(tracked.shutdown)
        return await self._get(cluster_id)

    async def _shutdown(self, cluster_id: int, tracked: _Tracked) -> None:
        schedule = stop_schedule(self.clock())
        if tracked.watcher is not None and tracked.watcher is not asyncio.current_task():
            tracked.watcher.cancel()
        # starts in flight end first (then their handles are stored); they are bounded by the
        # executor's own start timeouts
        starts = list(tracked.starts.values())
        if starts:
            await asyncio.wait(starts)
        cluster = await self._get(cluster_id)
        workers = await self._workers(cluster_id)
        await asyncio.gather(
            *(self._stop_worker(cluster, w, schedule.kill_workers_at) for w in workers),
            return_exceptions=True,
        )
        await self._stop_component(cluster_id, SCHEDULER_COMPONENT, SCHEDULER_STOP_GRACE_SECONDS)
        await self.capacity.release(scheduler_allocation_id(cluster.owner, cluster_id))
        if isinstance(self.executor, CleansUpEndedClusters):
            try:  # nothing of it runs now: its key and the workers' spill go
                await self.executor.cluster_ended(cluster)
            except Exception:
                log.exception("Dask cluster %d: removing its files failed", cluster_id)
        for _ in range(10):
            cluster = await self._get(cluster_id)
            if cluster.state is not ClusterState.STOPPING:
                break
            if await self._transition(cluster, Stopped(self.clock())) is not None:
                break
        if tracked.monitor is not None:
            with contextlib.suppress(Exception):
                await tracked.monitor.close()
            tracked.monitor = None
        pending_tasks = [t for t in tracked.tasks if t is not asyncio.current_task()]
        if pending_tasks:
            await asyncio.wait(pending_tasks, timeout=schedule.deadline - self.clock())
        log.info("Dask cluster %d stopped", cluster_id)
        self.wake()

    async def _stop_worker(self, cluster: Cluster, worker: Worker, kill_at: float) -> None:
        if worker.state is WorkerState.PENDING:
            await self._transition_worker(worker, Retire(self.clock(), cluster.reason or "stopped"))
            return
        if worker.state not in HOLDING_WORKER_STATES:
            return
        if worker.state is not WorkerState.RETIRING:
            retired = await self._transition_worker(
                worker, Retire(self.clock(), "its cluster stopped")
            )
            if retired is None:  # changed meanwhile (a retire of its own): as it is now
                retired = await asyncio.to_thread(self.store.get_worker, cluster.id, worker.number)
            worker = retired
        await self._stop_component(cluster.id, worker.name, kill_at - self.clock())
        await self.capacity.release(worker_allocation_id(cluster.owner, cluster.id, worker.number))
        if worker.state is WorkerState.RETIRING:
            await self._transition_worker(worker, Exited(self.clock()))

    async def server_stopped(self, owner: str, server: str) -> list[asyncio.Task[Cluster]]:
        """The owner's server `server` ("" the default one) stopped: its clusters that are not
        kept alive stop (in the background; the returned tasks end when they have)."""
        live = await asyncio.to_thread(
            self.store.list_clusters, owner=owner, states=set(LIVE_CLUSTER_STATES)
        )
        tasks = []
        for cluster in clusters_to_stop_with_server(live, owner, server):
            tasks.append(self._spawn(self.stop(cluster.id, server_stop_reason(server))))
        return tasks
