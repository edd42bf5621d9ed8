"""Admission: each pass places and starts a pending cluster's scheduler, scales a running
cluster to its target (within the owner's quota) and places every pending worker on its own, or
records why it waits; and retiring, which gives a surplus worker's share back once its process
is gone.

Apart from `service.py` (what a cluster's owner asks for, preemption and recovery) as the step
that runs by itself, at every pass of the admission loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from gpulab.hub.allocator import AllocationError, NoCapacity, Placement, QuotaExceeded
from gpulab.hub.allocator.units import fmt_gpus
from gpulab.hub.capacity_catalog import profile_milli
from gpulab.hub.dask import (
    LIVE_CLUSTER_STATES,
    WORKER_STOP_GRACE_SECONDS,
    AdmitWorker,
    Cluster,
    ClusterEnded,
    ClusterSpec,
    ClusterState,
    Exited,
    Launch,
    NearNotebook,
    Ready,
    Retire,
    Wait,
    Worker,
    WorkerFailed,
    WorkerState,
    active,
    adaptive_within_quota,
    desired_count,
    most_workers_within,
    near_notebook,
    plan_scale,
    quota_refusal,
    scheduler_request,
    worker_allocation_id,
    worker_request,
)
from gpulab.hub.jobs import PlacementSummary, share_label
from gpulab.hub.jobs.queue import quota_usage
from gpulab.hub.profiles import Profile

from .core import (
    ADAPTIVE_DOWN_AFTER,
    REPLACEMENT_PAUSE_AFTER,
    REPLACEMENT_PAUSE_SECONDS,
    SCHEDULER_COMPONENT,
    TLS_COMPONENT,
    _Tracked,
)
from .watching import DaskWatching

log = logging.getLogger("gpulab.dask")


class DaskAdmission(DaskWatching):
    """The admission pass, the owner's quota it keeps to, and retiring."""

    # -- quota ---------------------------------------------------------------------------------

    def _may_run_over_quota(self, spec: ClusterSpec, profile: Profile) -> bool:
        preemptible = spec.preemptible or profile.priority == "preemptible"
        return preemptible and self.capacity.allow_preemptible_over_quota

    def _quota_room(self, spec: ClusterSpec, profile: Profile) -> int | None:
        """Milli-GPU the owner may still take (None: no limit applies to these workers)."""
        if self._may_run_over_quota(spec, profile):
            return None
        return self.capacity.allocator.quota_left_milli(spec.owner, spec.groups)

    def _quota_refusal(
        self, spec: ClusterSpec, profile: Profile, n: int, held_milli: int
    ) -> str | None:
        return quota_refusal(
            n=n,
            worker_milli=profile_milli(profile),
            left_milli=self._quota_room(spec, profile),
            held_milli=held_milli,
            limit=self._limit_name(spec),
        )

    def _limit_name(self, spec: ClusterSpec) -> str:
        """The budget that binds the owner now: 'your GPU quota of 1 GPU', 'group students'
        GPU quota of 4 GPUs'."""
        quota = self.capacity.quota
        users, groups = quota_usage(self.capacity.allocator.allocations())
        candidates: list[tuple[int, str]] = []
        limit = quota.user_limit(spec.owner)
        if limit is not None:
            left = limit - users.get(spec.owner, 0)
            candidates.append((left, f"your GPU quota of {fmt_gpus(limit)}"))
        for group in sorted(spec.groups):
            glimit = quota.groups.get(group)
            if glimit is not None:
                left = glimit - groups.get(group, 0)
                candidates.append((left, f"group {group}'s GPU quota of {fmt_gpus(glimit)}"))
        if not candidates:
            return "your GPU quota"
        return min(candidates, key=lambda c: c[0])[1]

    def _held_milli(self, workers: Iterable[Worker]) -> int:
        return sum(
            sum(s.milli for s in w.placement.gpus)
            for w in workers
            if w.placement is not None
            and not w.placement.over_quota
            # a retiring worker's share is the cluster's until its process is gone, and then
            # its own again: a scale back up right after a scale down must not be refused for it
            and w.state in (WorkerState.ADMITTED, WorkerState.RUNNING, WorkerState.RETIRING)
        )

    # -- admission -----------------------------------------------------------------------------

    async def admit(self) -> None:
        """One admission pass over every live cluster, oldest first."""
        async with self._admitting:
            clusters = await asyncio.to_thread(
                self.store.list_clusters, states=set(LIVE_CLUSTER_STATES)
            )
            for cluster in clusters:
                tracked = self._track(cluster.id)
                if tracked.shutdown is not None:
                    continue
                async with tracked.lock:
                    await self._reconcile(cluster.id, tracked)

    async def _reconcile(self, cluster_id: int, tracked: _Tracked) -> None:
        cluster = await self._get(cluster_id)
        if cluster.state is ClusterState.PENDING:
            await self._place_scheduler(cluster, tracked)
        elif cluster.state is ClusterState.RUNNING:
            await self._scale_to_target(cluster, tracked)
            await self._admit_workers(cluster, tracked)

    async def _place_scheduler(self, cluster: Cluster, tracked: _Tracked) -> None:
        request = scheduler_request(
            cluster.owner,
            cluster.spec.groups,
            cluster.id,
            cpu_milli=self.scheduler_cpu_milli,
            memory_mib=self.scheduler_memory_mib,
            affinity_group=self.affinity_group_of(cluster),
        )
        try:
            placement = await self.capacity.place(request)
        except AllocationError as e:
            tracked.reason = f"the scheduler waits for a place: {e.reason}"
            return
        launched = await self._transition(
            cluster, Launch(self.clock(), PlacementSummary.of(placement))
        )
        if launched is None:  # stopped (or placed by another hub worker) meanwhile
            await self.capacity.release(request.id)
            return
        tracked.reason = ""
        task = self._spawn(self._start_scheduler(launched, placement, tracked), tracked)
        tracked.starts[SCHEDULER_COMPONENT] = task

    async def _start_scheduler(
        self, cluster: Cluster, placement: Placement, tracked: _Tracked
    ) -> None:
        try:
            tls = await self.tls_of(cluster.id)
            if tls is None:
                tls = await asyncio.to_thread(self.make_tls, cluster)
                await asyncio.to_thread(
                    self.store.set_handle,
                    cluster.id,
                    TLS_COMPONENT,
                    {"cert_pem": tls.cert_pem, "key_pem": tls.key_pem},
                )
            started = await self.executor.start_scheduler(cluster, placement, tls)
        except Exception as e:  # the executor left nothing running (its contract)
            log.warning("Dask cluster %d: the scheduler could not start: %s", cluster.id, e)
            self._spawn(self.stop(cluster.id, f"the scheduler could not start: {e}", failed=True))
            return
        await asyncio.to_thread(
            self.store.set_handle, cluster.id, SCHEDULER_COMPONENT, dict(started.handle)
        )
        ready = await self._transition(
            cluster, Ready(self.clock(), started.address, started.dashboard_url)
        )
        if ready is None:  # stopped meanwhile: the stop finds the handle and stops it
            return
        log.info("Dask cluster %d: scheduler at %s", cluster.id, started.address)
        self._watch(ready, tls, tracked)
        self.wake()

    def _target(self, cluster: Cluster, workers: list[Worker], tracked: _Tracked) -> int:
        current = len(active(workers))
        desired = desired_count(cluster, current, tracked.scheduler_target)
        if not cluster.adaptive:
            return desired
        profile = self.profile_of(cluster)
        if profile is None:
            return desired
        room = most_workers_within(self._quota_room(cluster.spec, profile), profile_milli(profile))
        target = adaptive_within_quota(desired, workers, room, cluster.minimum or 0)
        if target < current and tracked.fewer_wanted < ADAPTIVE_DOWN_AFTER:
            return current
        return target

    async def _scale_to_target(self, cluster: Cluster, tracked: _Tracked) -> None:
        workers = await self._workers(cluster.id)
        target = self._target(cluster, workers, tracked)
        plan = plan_scale(workers, target)
        if plan.retire and any(w.state is WorkerState.RUNNING for w in workers):
            # the scheduler knows whose data is cheapest to move
            close_first: list[str] = []
            if tracked.monitor is not None:
                running = sum(1 for w in workers if w.state is WorkerState.RUNNING)
                with contextlib.suppress(Exception):
                    close_first = await tracked.monitor.workers_to_close(running)
            plan = plan_scale(workers, target, close_first=close_first)
        recent = self.clock() - REPLACEMENT_PAUSE_SECONDS
        failing = [w for w in workers if w.state is WorkerState.FAILED and w.updated_at >= recent]
        if plan.add and len(failing) >= REPLACEMENT_PAUSE_AFTER:
            # workers that die as they start would be replaced at every pass, for good: the
            # cluster waits (its failed workers say why) and tries again after the pause
            return
        if plan.add:
            try:
                await asyncio.to_thread(self.store.add_workers, cluster.id, plan.add)
            except ClusterEnded:
                return
        by_number = {w.number: w for w in workers}
        for number in plan.retire:
            await self._retire(cluster, by_number[number], tracked, "scaled down")

    async def _admit_workers(self, cluster: Cluster, tracked: _Tracked) -> None:
        pending = await self._workers(cluster.id, {WorkerState.PENDING})
        profile = self.profile_of(cluster)
        waiting: str | None = None
        for worker in pending:
            if profile is None:
                waiting = f"profile {cluster.spec.profile!r} no longer exists"
            if waiting is None:
                waiting = await self._admit_worker(cluster, worker, profile, tracked)
                if waiting is None:
                    continue
            # the same request: what stopped this worker stops the ones after it
            if worker.reason != waiting:
                await self._transition_worker(worker, Wait(self.clock(), waiting))

    async def _admit_worker(
        self, cluster: Cluster, worker: Worker, profile: Profile | None, tracked: _Tracked
    ) -> str | None:
        """Place and start one pending worker; why it waits, or None once it was admitted."""
        assert profile is not None
        base = self.capacity.request_for(
            profile,
            allocation_id="-",
            owner=cluster.owner,
            groups=cluster.spec.groups,
            workload="dask",
        )
        request = worker_request(
            base,
            owner=cluster.owner,
            cluster_id=cluster.id,
            number=worker.number,
            preemptible=cluster.spec.preemptible,
            affinity_group=self.affinity_group_of(cluster),
            near=self._near_notebook(cluster),
        )
        label = share_label(profile.num_gpu, profile.gpu_milli)
        try:
            placement = await self.capacity.place(request)
        except QuotaExceeded as e:
            return f"waiting for quota: {e.reason}"
        except NoCapacity as e:
            return f"waiting for a free {label}: {e.reason}"
        except AllocationError as e:
            return f"waiting: {e.reason}"
        admitted = await self._transition_worker(
            worker, AdmitWorker(self.clock(), PlacementSummary.of(placement))
        )
        if admitted is None:  # retired (or admitted by another hub worker) meanwhile
            await self.capacity.release(request.id)
            return None
        task = self._spawn(self._start_worker(cluster, admitted, placement), tracked)
        tracked.starts[admitted.name] = task
        task.add_done_callback(lambda _t: tracked.starts.pop(admitted.name, None))
        return None

    def _near_notebook(self, cluster: Cluster) -> NearNotebook | None:
        """The node (and NVLink group) of the notebook's server while it holds an allocation:
        workers are placed there first, then in its rack, then anywhere (decision 0003)."""
        allocation = self.notebook_of(cluster)
        notebook = self.capacity.allocator.get(allocation) if allocation else None
        return near_notebook(notebook, self.capacity.inventory)

    async def _start_worker(self, cluster: Cluster, worker: Worker, placement: Placement) -> None:
        tls = await self.tls_of(cluster.id)
        try:
            assert tls is not None, "the cluster's TLS material is missing"
            # issued once the share is held, so the allocator's release revokes it with the
            # share; a worker without a GPU has nothing to report, so it gets no token at all
            report_for = self.report_for if placement.gpus else None
            report = report_for(placement.request.id) if report_for is not None else None
            handle = await self.executor.start_worker(
                cluster, worker, placement, cluster.scheduler_address, tls, report
            )
        except Exception as e:  # the executor left nothing running (its contract)
            log.warning(
                "Dask cluster %d: worker %s could not start: %s", cluster.id, worker.name, e
            )
            await self._transition_worker(
                worker, WorkerFailed(self.clock(), f"could not start: {e}")
            )
            await self.capacity.release(placement.request.id)
            return
        await asyncio.to_thread(self.store.set_handle, cluster.id, worker.name, dict(handle))
        log.info(
            "Dask cluster %d: worker %s started on %s", cluster.id, worker.name, placement.node
        )

    # -- retiring ------------------------------------------------------------------------------

    async def _retire(
        self, cluster: Cluster, worker: Worker, tracked: _Tracked, reason: str
    ) -> None:
        retired = await self._transition_worker(worker, Retire(self.clock(), reason))
        if retired is None or retired.state is not WorkerState.RETIRING:
            return  # a pending worker stops at once (it held nothing); or it changed meanwhile
        self._spawn(self._finish_retiring(cluster, retired, tracked, ask_scheduler=True), tracked)

    async def _finish_retiring(
        self, cluster: Cluster, worker: Worker, tracked: _Tracked, *, ask_scheduler: bool
    ) -> None:
        """Move its data away (the scheduler's retire), stop its process, then free its share."""
        start = tracked.starts.get(worker.name)
        if start is not None:
            await asyncio.wait([start])
        if ask_scheduler and tracked.monitor is not None:
            with contextlib.suppress(Exception):
                await tracked.monitor.retire([worker.name], timeout=WORKER_STOP_GRACE_SECONDS)
        await self._stop_component(cluster.id, worker.name, WORKER_STOP_GRACE_SECONDS)
        # its process is gone: the share is free before anyone reads the worker as stopped
        await self.capacity.release(worker_allocation_id(cluster.owner, cluster.id, worker.number))
        current = await asyncio.to_thread(self.store.get_worker, cluster.id, worker.number)
        if current.state is WorkerState.RETIRING:
            await self._transition_worker(current, Exited(self.clock()))
        self.wake()
