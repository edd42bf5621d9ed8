"""The job service: queue, admission, execution and recovery of GPU job runs, in the hub process.

Why in the hub and not a managed hub service (decision record 0002): a run is admitted by the
same allocator, quotas, headroom and priorities as a notebook server, and a hub holds one
allocator (`GPUCapacity`); a second process would be a second owner of allocations. What must
outlive the hub does: runs, attempts and executor handles are in the job store, attempts run as
processes or Kubernetes Jobs that are no children of the hub, and `recover()` finds them again.

A run's life here, with the store's compare-and-set at every step (`JobStore.transition`):

    submit   checks the profile (exists, visible to the owner, fits the machine, within the
             owner's whole quota: else `JobRefused`, a 4xx) and queues the run;
    admit    in queue order (priority, then submission), each queued run the allocator can place
             now is admitted (best-effort FIFO, as Kueue's default: a run that does not fit
             waits with its reason and does not hold back smaller ones behind it), started by
             the executor, its handle stored, marked running and watched;
    watch    when the executor says the attempt ended (nothing of it runs any more), the run
             takes the outcome (succeeded, failed, timed out, canceled), its GPU share is given
             back, its outputs are recorded and, where retries are left, it is queued again;
             an attempt that failed before the job's own code started (the executor's
             `platform_failure`: a kernel or wrapper that did not start, a pod that never ran
             or was evicted, a start the executor could not make) is queued again after a
             back-off (`platform_retry_backoff_seconds`, doubled each time) without counting
             against `max_retries`, at most `PLATFORM_RETRIES` times a run;
    cancel   a queued run is canceled at once; a running one is stopped by the executor and
             canceled when nothing of it runs, its share given back before `cancel` returns;
    recover  after a hub restart: attempts that still run are watched again, attempts that
             ended while the hub was away take their outcome, an attempt admitted but never
             started fails as the platform's failure (and is retried), and a run whose retry
             the stopped hub had not made yet is queued again.

The allocation of a run's attempt is `<owner>/job-<run id>` (`allocation_id`): the hub's
reconciliation keeps these while their runs hold a share (`live_allocation_ids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpulab.hub.allocator import AllocationError, NoCapacity, Placement, QuotaExceeded, Request
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.capacity_catalog import ProfileUnavailable, profile_milli
from gpulab.hub.hub_service import admission_loop
from gpulab.hub.jobs import (
    HOLDING_STATES,
    RETRYABLE_STATES,
    Admit,
    Cancel,
    Fail,
    JobSpec,
    JobStore,
    Output,
    PlacementSummary,
    Preempt,
    Retry,
    Run,
    RunState,
    Start,
    Succeed,
    queue_order,
    share_label,
)
from gpulab.hub.profiles import Profile, format_gpu_amount

from .executor import Handle, JobExecutor

log = logging.getLogger("gpulab.jobs")


class JobRefused(Exception):
    """A submission that can never run as asked: `status` is the HTTP status (400 for a wrong
    request, 403 for one beyond the owner's rights or quota), `field` what to change."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message = status, field, message


def allocation_id(run: Run) -> str:
    return f"{run.owner}/job-{run.id}"


def run_id_of(allocation: str) -> int | None:
    """The run id of a job run's allocation id, None for any other allocation."""
    _owner, sep, rest = allocation.rpartition("/job-")
    return int(rest) if sep and rest.isdigit() else None


def live_allocation_ids(store: JobStore) -> set[str]:
    """The allocations the store's runs hold now (blocking: a store read)."""
    return {allocation_id(run) for run in store.list_runs(states=set(HOLDING_STATES))}


NOT_YET_CONSIDERED = "queued; the next admission pass decides"


def whole_quota_refusal(
    capacity: GPUCapacity,
    profile: Profile,
    owner: str,
    groups: frozenset[str],
    *,
    preemptible: bool = False,
) -> str | None:
    """Why a job run of `profile` is refused at submission for her quota (None: it is not): it
    needs more than the smallest budget that applies to her with nothing else running, so it
    would wait forever. A preemptible run may run over quota where the hub allows it. The lab's
    dialogs mark such a profile before Submit (`GET /hub/api/gpulab/capacity`)."""
    quota = capacity.quota
    limits = [quota.user_limit(owner)] + [quota.groups.get(g) for g in groups]
    known = [limit for limit in limits if limit is not None]
    limit = min(known) if known else None
    needed = profile_milli(profile)
    if limit is None or needed <= limit:
        return None
    if (preemptible or profile.priority == "preemptible") and capacity.allow_preemptible_over_quota:
        return None
    return (
        f"{profile.slug} needs {format_gpu_amount(needed)}, more than your whole GPU "
        f"quota of {format_gpu_amount(limit)}: it could never start"
    )


class JobService:
    """See the module docstring. One per hub; `start()` runs its admission loop."""

    def __init__(
        self,
        store: JobStore,
        capacity: GPUCapacity,
        executor: JobExecutor,
        *,
        clock: Callable[[], float] = time.time,
        admission_interval_seconds: float = 5.0,
        report_for: Callable[[str], Mapping[str, str] | None] | None = None,
        platform_retry_backoff_seconds: float = 5.0,
    ) -> None:
        self.store, self.capacity, self.executor, self.clock = store, capacity, executor, clock
        #: an attempt's GPU report for its allocation id (the hub's `ReportTokens.issue`: a
        #: token of its own, revoked when the share is given back); None: no reports
        self.report_for = report_for
        self.admission_interval_seconds = admission_interval_seconds
        #: admission passes and starts one at a time: a cancel waits for a start in progress
        self._admitting = asyncio.Lock()
        self._wake = asyncio.Event()
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._canceling: dict[int, str] = {}
        #: runs being preempted (their attempt ends as preempted, whatever its exit): reasons
        self._preempting: dict[int, str] = {}
        #: the task running an admission pass: it holds `_admitting` while it places runs, and a
        #: placement may evict a preemptible run (`preempt`), which must not wait for itself
        self._admission_task: asyncio.Task[Any] | None = None
        #: why each queued run waits (in memory: it changes with every pass)
        self._reasons: dict[int, str] = {}
        self._loop_task: asyncio.Task[None] | None = None
        #: job specs by job id: a job's spec never changes, so each is read once
        self._specs: dict[int, JobSpec] = {}
        #: the first wait before a platform failure's retry (doubled with each one of a run)
        self.platform_retry_backoff_seconds = platform_retry_backoff_seconds
        #: retries waiting out their back-off, by run id
        self._retrying: dict[int, asyncio.Task[None]] = {}

    # -- submission ----------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, *, is_admin: bool = False) -> Run:
        """Queue a run of `spec` (its owner and groups are the submitter's: the caller sets
        them from the hub's user, never from the request). JobRefused when it can never run."""
        self._check_profile(spec, is_admin)
        run = await asyncio.to_thread(self.store.submit, spec)
        log.info("job run %d of %s queued (%s)", run.id, spec.owner, spec.profile)
        self.wake()
        return run

    def _check_profile(self, spec: JobSpec, is_admin: bool) -> Profile:
        try:
            profile = self.capacity.workload_profile(spec.profile, spec.groups, is_admin)
        except ProfileUnavailable as e:
            raise JobRefused(400, "profile", str(e)) from None
        refusal = whole_quota_refusal(
            self.capacity, profile, spec.owner, spec.groups, preemptible=spec.preemptible
        )
        if refusal:
            raise JobRefused(403, "profile", refusal)
        return profile

    def _request(self, run: Run, spec: JobSpec, profile: Profile) -> Request:
        request = self.capacity.request_for(
            profile,
            allocation_id=allocation_id(run),
            owner=spec.owner,
            groups=spec.groups,
            workload="job",
        )
        if spec.preemptible and request.priority != "preemptible":
            # a preemptible job may be evicted for on-demand work, whatever its profile says
            request = dataclasses.replace(request, priority="preemptible")
        return request

    # -- admission -----------------------------------------------------------------------------

    def wake(self) -> None:
        """Run an admission pass soon (a run was queued, or a share was given back)."""
        self._wake.set()

    def waiting_reason(self, run: Run) -> str | None:
        """Why a queued run waits (None for a run that is not queued). A run queued since the
        last admission pass has no verdict yet, and says so rather than nothing."""
        if run.state is not RunState.QUEUED:
            return None
        return self._reasons.get(run.id, NOT_YET_CONSIDERED)

    async def admit(self) -> list[Run]:
        """One admission pass; returns the runs it started."""
        async with self._admitting:
            self._admission_task = asyncio.current_task()
            try:
                return await self._admit_queued()
            finally:
                self._admission_task = None

    async def _admit_queued(self) -> list[Run]:
        started = []
        queued = await asyncio.to_thread(self.store.list_runs, states={RunState.QUEUED})
        for run in queue_order(queued):
            running = await self._try_admit(run)
            if running is not None:
                started.append(running)
        queued_ids = {r.id for r in queued}
        for run_id in list(self._reasons):
            if run_id not in queued_ids:
                del self._reasons[run_id]
        return started

    async def spec_of(self, job_id: int) -> JobSpec:
        """The spec of job `job_id` (read from the store once; specs never change)."""
        spec = self._specs.get(job_id)
        if spec is None:
            spec = self._specs[job_id] = (await asyncio.to_thread(self.store.get_job, job_id)).spec
        return spec

    async def _try_admit(self, run: Run) -> Run | None:
        spec = await self.spec_of(run.job_id)
        profile = self.capacity.profile(spec.profile)
        if profile is None:  # the admin removed it while the run waited
            await self._transition(
                run, Cancel(self.clock(), reason=f"profile {spec.profile!r} no longer exists")
            )
            return None
        request = self._request(run, spec, profile)
        try:
            placement = await self.capacity.place(request)
        except QuotaExceeded as e:
            self._reasons[run.id] = f"waiting for quota: {e}"
            return None
        except NoCapacity:
            label = share_label(profile.num_gpu, profile.gpu_milli)
            self._reasons[run.id] = f"waiting for a free {label}"
            return None
        except AllocationError as e:
            self._reasons[run.id] = f"waiting: {e}"
            return None
        self._reasons.pop(run.id, None)
        admitted = await self._transition(run, Admit(self.clock(), PlacementSummary.of(placement)))
        if admitted is None:  # canceled (or admitted by another hub worker) meanwhile
            await self.capacity.release(request.id)
            return None
        return await self._start(admitted, spec, placement)

    async def _start(self, run: Run, spec: JobSpec, placement: Placement) -> Run | None:
        try:
            report = self.report_for(allocation_id(run)) if self.report_for else None
            handle = await self.executor.start(run, spec, placement, report)
        except Exception as e:  # the executor left nothing running (its contract)
            log.warning("job run %d could not start: %s", run.id, e)
            # nothing of the job ran: the platform's failure, retried without counting
            failed = await self._transition(
                run, Fail(self.clock(), reason=f"could not start: {e}", platform_failure=True)
            )
            await self.capacity.release(allocation_id(run))
            if failed is not None:
                await self._retry_if_allowed(failed)
            return None
        attempt = run.attempt
        assert attempt is not None  # an admitted run has its attempt
        await asyncio.to_thread(self.store.set_handle, run.id, attempt.number, dict(handle))
        running = await self._transition(run, Start(self.clock()))
        if running is None:
            # changed under us (a cancel from another hub worker): stop what was started
            await self.executor.cancel(handle)
            await self.capacity.release(allocation_id(run))
            return None
        self._watch(running, handle)
        log.info("job run %d attempt %d running on %s", run.id, attempt.number, placement.node)
        return running

    def _watch(self, run: Run, handle: Handle) -> None:
        task = asyncio.create_task(self._watch_attempt(run, handle))
        self._watchers[run.id] = task

        def forget(_task: asyncio.Task[None]) -> None:
            self._watchers.pop(run.id, None)

        task.add_done_callback(forget)

    async def _watch_attempt(self, run: Run, handle: Handle) -> None:
        outcome = await self.executor.wait(handle)
        event = outcome.event(self.clock())
        reason = self._canceling.pop(run.id, None)
        preempted = self._preempting.pop(run.id, None)
        if preempted is not None and not isinstance(event, Succeed):
            # stopped for on-demand work: retried (not counted against max_retries) and, where
            # it wrote a checkpoint, resumed from it
            event = Preempt(event.at, reason=preempted)
        elif isinstance(event, Cancel) and reason:
            event = Cancel(event.at, reason=reason)
        # outputs first: whoever sees the run ended sees what it wrote (the lab's job list
        # read a succeeded run with no files in between)
        with contextlib.suppress(Exception):  # outputs are a convenience; the run's end is not
            files = await self.executor.outputs(handle)
            await asyncio.to_thread(
                self.store.add_outputs, run.id, [Output(p, size) for p, size in files]
            )
        ended = await self._transition(run, event)
        # the executor's wait returns only when nothing of the attempt runs: free the share now
        await self.capacity.release(allocation_id(run))
        if ended is not None:
            log.info("job run %d: %s", run.id, ended.state.value)
            await self._retry_if_allowed(ended)
        self.wake()

    async def _retry_if_allowed(self, run: Run) -> None:
        if not (run.state in RETRYABLE_STATES and run.retry_allowed):
            return
        attempt = run.attempt
        # a lost node's run moves to another node at once; a job that failed to start waits
        if (
            attempt is not None
            and attempt.platform_failure
            and attempt.outcome is not RunState.PREEMPTED
            and run.id not in self._retrying
        ):
            delay = self.platform_retry_backoff_seconds * 2 ** (run.platform_failures - 1)
            log.warning(
                "job run %d attempt %d failed before the job's code started (%s); "
                "retrying in %.1f s, not counted against max_retries",
                run.id,
                attempt.number,
                attempt.reason,
                delay,
            )
            task = asyncio.create_task(self._retry_after(run, delay))
            self._retrying[run.id] = task
            task.add_done_callback(lambda _task: self._retrying.pop(run.id, None))
            return
        await self._retry(run)

    async def _retry_after(self, run: Run, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._retry(run)  # a cancel meanwhile changed its version: then nothing happens

    async def _retry(self, run: Run) -> None:
        again = await self._transition(run, Retry(self.clock()))
        if again is not None:
            log.info("job run %d queued again (attempt %d next)", run.id, len(run.attempts) + 1)
            self.wake()

    async def _transition(self, run: Run, event: Any) -> Run | None:
        return await asyncio.to_thread(
            self.store.transition,
            run.id,
            event,
            expected_state=run.state,
            expected_version=run.version,
        )

    # -- cancel --------------------------------------------------------------------------------

    async def cancel(self, run_id: int, reason: str = "canceled by its owner") -> Run:
        """Cancel the run; when it ran, return only once nothing of it runs and its GPU share
        is free. A run that has ended is returned as it is."""
        for _ in range(10):  # a run may change between the read and the write: read again
            run = await asyncio.to_thread(self.store.get_run, run_id)
            if run.is_terminal:
                return run
            if run.state in HOLDING_STATES:
                await self._cancel_attempt(run, reason)
                return await asyncio.to_thread(self.store.get_run, run_id)
            if await self._transition(run, Cancel(self.clock(), reason=reason)) is not None:
                self._reasons.pop(run_id, None)
                return await asyncio.to_thread(self.store.get_run, run_id)
        raise RuntimeError(f"job run {run_id} kept changing while it was canceled")

    async def _cancel_attempt(self, run: Run, reason: str) -> None:
        self._canceling[run.id] = reason
        await self._stop_attempt(run)

    async def _stop_attempt(self, run: Run) -> None:
        if asyncio.current_task() is self._admission_task:
            watcher = self._watchers.get(run.id)  # this pass is the one placing: no start runs
        else:
            async with self._admitting:  # a start in progress ends first (then it has a watcher)
                watcher = self._watchers.get(run.id)
        attempt = run.attempt
        handle = (
            await asyncio.to_thread(self.store.handle, run.id, attempt.number)
            if attempt is not None
            else None
        )
        if handle is not None:
            await self.executor.cancel(handle)
        if watcher is not None:
            await asyncio.shield(watcher)

    # -- preemption ----------------------------------------------------------------------------

    def owns_allocation(self, allocation: str) -> bool:
        """Whether `allocation` is a job run's (`<owner>/job-<run id>`)."""
        return run_id_of(allocation) is not None

    async def preempt(self, placement: Placement, reason: str) -> None:
        """The capacity's evictor for job runs: stop the run's attempt for on-demand work (its
        share is already the newcomer's) and return when nothing of it runs. The attempt gets
        the executor's grace period after SIGTERM (or the Job's deletion) to write a checkpoint;
        the run is then preempted and queued again."""
        run_id = run_id_of(placement.request.id)
        if run_id is None:
            return
        run = await asyncio.to_thread(self.store.get_run, run_id)
        if run.state not in HOLDING_STATES:
            return
        log.warning("job run %d preempted: %s", run_id, reason)
        self._preempting[run_id] = reason
        await self._stop_attempt(run)

    # -- recovery and the loop -----------------------------------------------------------------

    async def recover(self) -> None:
        """After a hub restart: watch the attempts that still run, settle those that ended or
        never started (see the module docstring)."""
        holding = await asyncio.to_thread(self.store.list_runs, states=set(HOLDING_STATES))
        for run in holding:
            if run.id in self._watchers:
                continue
            attempt = run.attempt
            handle = (
                await asyncio.to_thread(self.store.handle, run.id, attempt.number)
                if attempt is not None
                else None
            )
            if handle is None or run.state is RunState.ADMITTED:
                if handle is not None:  # started, but the hub stopped before it said so
                    await self.executor.cancel(handle)
                failed = await self._transition(
                    run,
                    Fail(
                        self.clock(),
                        reason="the hub restarted before the run started",
                        platform_failure=True,
                    ),
                )
                await self.capacity.release(allocation_id(run))
                if failed is not None:
                    await self._retry_if_allowed(failed)
                continue
            still_running = await self.executor.reattach(handle)
            log.info(
                "job run %d: %s after the hub restart",
                run.id,
                "still running" if still_running else "ended while the hub was away",
            )
            self._watch(run, handle)
        # runs whose retry the stopped hub had not made (one waiting out its back-off)
        ended = await asyncio.to_thread(self.store.list_runs, states=set(RETRYABLE_STATES))
        for run in ended:
            if run.id not in self._watchers:
                await self._retry_if_allowed(run)

    def live_allocation_ids(self) -> set[str]:
        """The allocations runs hold now (blocking: a store read), which the hub's
        reconciliation of allocations must keep."""
        return live_allocation_ids(self.store)

    async def start(self) -> None:
        """Recover, then admit whenever woken (a submission, a share given back) and every
        `admission_interval_seconds` (quotas and capacity change without telling us)."""
        await self.recover()
        self.capacity.add_evictor(self.owns_allocation, self.preempt)
        self._loop_task = asyncio.create_task(self._admission_loop())

    async def _admission_loop(self) -> None:
        await admission_loop(self.admit, self._wake, self.admission_interval_seconds, log, "job")

    async def stop(self) -> None:
        """Stop admitting and watching (the attempts keep running: a restarted hub recovers
        them)."""
        self.capacity.remove_evictor(self.preempt)
        waiting = (*self._watchers.values(), *self._retrying.values())
        tasks = [t for t in (self._loop_task, *waiting) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None


__all__ = [
    "JobRefused",
    "JobService",
    "allocation_id",
    "live_allocation_ids",
    "whole_quota_refusal",
]
