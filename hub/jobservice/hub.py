"""The job service inside a running hub: its options (`GPUJobs`), its store, its executor from the
hub's spawner class, and its start once the hub has started.

`gpulab.hub.config.GPULabHubHooks` calls `GPUJobs.instance(...).attach_to_hub(app)` while the hub
initialises: the store opens at once (so that the hub's reconciliation of GPU allocations, at the
first spawn, keeps the shares that job runs hold), and the service starts after the hub has
(its users, spawners and proxy are loaded): recovery of the attempts that ran through a restart,
then the admission loop. The REST handlers reach it through `GPUJobs.instance().service`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Integer, TraitError, Unicode, validate
from traitlets.config import SingletonConfigurable

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.hub_service import hub_started, wait_started
from gpulab.hub.jobs import JobStore
from gpulab.hub.report_tokens import ReportTokens

from .executor import RunsJobs
from .service import JobService, live_allocation_ids

#: the runs folder's name in the hub's state directory (users pass through it to their logs)
RUNS_DIR = "job-runs"


class GPUJobs(SingletonConfigurable):
    """GPU jobs: runs of notebooks and scripts on a GPU share, queued and admitted by the same
    allocator and quotas as servers (see gpulab.hub.jobservice)."""

    enabled = Bool(
        True,
        config=True,
        help="""Accept GPU jobs (/hub/api/gpulab/jobs). Needs a spawner class whose backend runs
        jobs (gpulab's local spawners; Kubernetes next); with another one the API answers 501.""",
    )
    db_url = Unicode(
        "sqlite:///gpulab-jobs.sqlite",
        config=True,
        help="""Where jobs, runs and their attempts are kept, in SQLAlchemy's URL style:
        'sqlite:///path' (relative to the hub's working directory; the embedded default) or
        'postgresql://user@host/db' for cluster installs (needs gpulab[postgres]); runs outlive
        hub restarts.""",
    )
    runs_dir = Unicode(
        RUNS_DIR,
        config=True,
        help="""The hub's folder for the attempts' logs and records (relative to the hub's
        working directory). Users read their own logs there through the hub, and pass through it
        to them: it is made 0711, each run's folder is its owner's group's alone.""",
    )
    admission_interval_seconds = Float(
        5.0,
        config=True,
        help="""How often queued runs are tried again without being woken (a submission or a
        GPU share given back wakes the queue at once; quotas and capacity may change without
        telling it).""",
    )

    kernel_start_timeout_seconds = Integer(
        60,
        config=True,
        help="""How long a notebook job's kernel may take to start, in whole seconds (nbclient's
        start-up wait, whose own default is 60 s) before its attempt has failed before the job's
        code started.
        Such an attempt is the platform's failure, not the job's: it is retried without counting
        against the run's max_retries (at most 3 times a run), its cause in the attempt's
        reason. Raise it on a loaded machine whose kernels start slowly.""",
    )
    platform_retry_backoff_seconds = Float(
        5.0,
        config=True,
        help="""How long a run waits before it is queued again after an attempt that failed
        before the job's code started (a kernel or wrapper that did not start, a pod that never
        ran or was evicted), doubled after each such failure of the same run: 5, 10, 20 s by
        default. What failed may be the machine's load, which a moment's wait lets pass.
        A run whose node was lost moves to another node at once (no wait); lost nodes count
        among the 3 platform failures a run is allowed.""",
    )

    @validate("kernel_start_timeout_seconds")
    def _kernel_start_timeout(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if value < 1:
            raise TraitError(
                f"GPUJobs.kernel_start_timeout_seconds must be at least 1 second, got {value!r}"
            )
        return value

    @validate("platform_retry_backoff_seconds")
    def _backoff(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value < 0:
            raise TraitError(
                f"GPUJobs.platform_retry_backoff_seconds must be 0 or more, got {value!r}"
            )
        return value

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store: JobStore | None = None
        self.service: JobService | None = None
        #: why the service does not run (None: it runs or is starting)
        self.unavailable: str | None = None
        self._starting: asyncio.Task[None] | None = None

    def attach_to_hub(self, app: Any) -> None:
        """Open the store now, and start the service once the hub has started (see the module
        docstring). Called while the hub initialises, in its event loop."""
        if not self.enabled:
            self.unavailable = "GPU jobs are switched off on this hub (GPUJobs.enabled)"
            return
        if not isinstance(app.spawner_class, RunsJobs):
            self.unavailable = f"{app.spawner_class.__name__} runs no GPU jobs"
            return
        self.store = JobStore(self.db_url)
        capacity = GPUCapacity.instance(config=self.config, log=self.log)
        store = self.store
        capacity.keep_allocations(lambda: live_allocation_ids(store))
        self._starting = asyncio.ensure_future(self._start_after_hub(app, capacity))

    async def wait_started(self, timeout: float) -> None:
        """Return once the service has started (or could not start), or after `timeout` s."""
        await wait_started(self._starting, timeout)

    async def _start_after_hub(self, app: Any, capacity: GPUCapacity) -> None:
        await hub_started(app)
        runs = await asyncio.to_thread(_passable_dir, Path(self.runs_dir))

        async def spawner_for(owner: str) -> Any:
            return app.users[owner].spawner

        assert self.store is not None
        executor = app.spawner_class.job_executor(
            runs_dir=str(runs),
            gpu_of=capacity.gpu_by_uuid,
            spawner_for=spawner_for,
            kernel_start_timeout_seconds=self.kernel_start_timeout_seconds,
        )
        reports = ReportTokens.of(app)
        service = JobService(
            self.store,
            capacity,
            executor,
            admission_interval_seconds=self.admission_interval_seconds,
            report_for=reports.issue,
            platform_retry_backoff_seconds=self.platform_retry_backoff_seconds,
        )
        try:
            # the allocator reflects the inventory before the first submission is checked against
            # it and before recovery (on Kubernetes: the cluster's watches synced, so job pods'
            # placements are allocations again; a no-op for an inventory of this machine)
            await capacity.ready()
            await service.start()
            reports.sweep()  # after recovery: runs that ended while the hub was away
        except Exception as e:
            self.log.exception("gpulab: GPU jobs could not start")
            self.unavailable = f"GPU jobs could not start: {e}"
            return
        self.service = service
        self.log.info("gpulab: GPU jobs running (store %s)", self.db_url.split("@")[-1])


def _passable_dir(path: Path) -> Path:
    """The runs folder, made 0711 (users pass through to their own runs' folders); absolute."""
    path.mkdir(mode=0o711, exist_ok=True)
    path.chmod(0o711)
    return path.resolve()
