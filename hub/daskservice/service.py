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

Pure of JupyterHub (the REST handlers and `GPUDask` wire it into a hub), as the job service is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpulab.hub.allocator import AllocationError, NoCapacity, Placement, QuotaExceeded
from gpulab.hub.allocator.units import fmt_gpus
from gpulab.hub.capacity import GPUCapacity, ProfileUnavailable, profile_milli
from gpulab.hub.dask import (
    HOLDING_WORKER_STATES,
    LIVE_CLUSTER_STATES,
    SCHEDULER_STOP_GRACE_SECONDS,
    WORKER_STOP_GRACE_SECONDS,
    Activity,
    Adapt,
    AdmitWorker,
    Cluster,
    ClusterEnded,
    ClusterNotFound,
    ClusterSpec,
    ClusterState,
    ClusterStore,
    Exited,
    IllegalTransition,
    Joined,
    Launch,
    NearNotebook,
    Preempted,
    Ready,
    Retire,
    Scale,
    SetKeepAlive,
    Stop,
    Stopped,
    Wait,
    Worker,
    WorkerFailed,
    WorkerState,
    active,
    adaptive_within_quota,
    clusters_to_stop_with_server,
    desired_count,
    idle_expired,
    idle_stop_reason,
    idle_timeout,
    most_workers_within,
    near_notebook,
    next_idle_since,
    parse_allocation_id,
    plan_scale,
    quota_refusal,
    scheduler_allocation_id,
    scheduler_request,
    server_stop_reason,
    stop_schedule,
    worker_allocation_id,
    worker_request,
)
from gpulab.hub.hub_service import admission_loop
from gpulab.hub.jobs import PlacementSummary, share_label
from gpulab.hub.jobs.queue import quota_usage
from gpulab.hub.profiles import Profile

from .executor import (
    CleansUpEndedClusters,
    ClusterTLS,
    DaskExecutor,
    Handle,
    KeepsWarmLaunchers,
)
from .monitor import SchedulerMonitor, SchedulerView

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


class DaskRefused(Exception):
    """A request that cannot be done as asked: ``status`` is the HTTP status (400 a wrong
    request, 403 beyond the owner's rights or quota, 409 a state that does not allow it),
    ``field`` what to change."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message = status, field, message


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


class DaskService:
    """See the module docstring. One per hub; `start()` recovers and runs admission."""

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

    # -- admission -----------------------------------------------------------------------------

    def wake(self) -> None:
        """Run an admission pass soon."""
        self._wake.set()

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
        current = await asyncio.to_thread(self.store.get_worker, cluster.id, worker.number)
        if current.state is WorkerState.RETIRING:
            await self._transition_worker(current, Exited(self.clock()))
        await self.capacity.release(worker_allocation_id(cluster.owner, cluster.id, worker.number))
        self.wake()

    async def _stop_component(self, cluster_id: int, component: str, grace: float) -> None:
        handle = await self._handle(cluster_id, component)
        if handle is not None:
            await self.executor.stop(handle, max(0.0, grace))

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
        if worker.state is WorkerState.RETIRING:
            await self._transition_worker(worker, Exited(self.clock()))
        await self.capacity.release(worker_allocation_id(cluster.owner, cluster.id, worker.number))

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


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("Dask cluster service task failed", exc_info=task.exception())


__all__ = ["NOT_YET_CONSIDERED", "DaskRefused", "DaskService", "IllegalTransition"]
