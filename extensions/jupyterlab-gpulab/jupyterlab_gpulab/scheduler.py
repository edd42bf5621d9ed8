"""gpulab's backend for jupyter-scheduler: its "Create job" form, job list and REST API
(`/scheduler/jobs...`) hand runs to the hub's job service instead of running them in this server.

Why the hub and not this server: jupyter-scheduler's stock scheduler runs a job as a child of the
server, so the job dies when the server is culled or stopped; the hub's job service queues it
under the same allocator and quotas as servers and runs it outside any server. Configured as the
default by the extension's server config (`jupyter-config/server-config/jupyterlab_gpulab.json`:
`SchedulerApp.scheduler_class` and `environment_manager_class`).

- `GPUProfileEnvironments`: one runtime environment, `gpulab`, whose compute types are the
  owner's GPU profiles with live capacity and her remaining quota in their labels (the hub's
  `/hub/api/gpulab/capacity`, asked again each time the form opens).
- `GPULabScheduler`: create -> POST a run; list/get -> the hub's runs (`jobmapping.describe`);
  stop -> cancel (the GPU share is free when it answers); delete -> cancel when still active
  (the hub keeps every run's history). Job definitions (schedules) stay the stock scheduler's,
  in this server's database; each job one creates goes to the hub like any other.

The hub's refusals (a profile over quota, a bad parameter) come back as `SchedulerError` with the
hub's message naming the field; jupyter-scheduler's handlers answer every SchedulerError with a
500 carrying that message (their choice; gpulab's own `gpulab/jobs` API answers 4xx).
"""

from __future__ import annotations

import os
from typing import Any

from jupyter_scheduler.environments import EnvironmentManager, EnvironmentRetrievalError
from jupyter_scheduler.exceptions import SchedulerError
from jupyter_scheduler.models import (
    CountJobsQuery,
    CreateJob,
    DescribeJob,
    ListJobsQuery,
    ListJobsResponse,
    RuntimeEnvironment,
    Status,
    UpdateJob,
)
from jupyter_scheduler.scheduler import Scheduler

from . import jobmapping
from .hubjobs import HubError, HubJobs, HubUnavailable


def _hub() -> HubJobs:
    try:
        return HubJobs.from_env()
    except HubUnavailable as e:
        raise SchedulerError(str(e)) from None


class GPUProfileEnvironments(EnvironmentManager):
    """The `gpulab` environment; its compute types are the owner's GPU profiles, labelled."""

    async def list_environments(self) -> list[RuntimeEnvironment]:  # type: ignore[override]
        try:
            capacity = await HubJobs.from_env().capacity()
        except (HubUnavailable, HubError) as e:
            raise EnvironmentRetrievalError(str(e)) from None
        quota = capacity.get("quota")
        types = [jobmapping.compute_type_label(p, quota) for p in capacity["profiles"]]
        # the form opens on the first GPU profile: a GPU job is what this environment is for
        gpu_types = [
            t for p, t in zip(capacity["profiles"], types, strict=True) if jobmapping.has_gpu(p)
        ]
        return [
            RuntimeEnvironment(
                name=jobmapping.ENVIRONMENT_NAME,
                label="GPU job (gpulab)",
                description=(
                    "Runs on a GPU share of the hub, outside this server: queued under your quota, "
                    "kept when this server stops. " + (capacity.get("inventory") or "")
                ),
                file_extensions=["ipynb", "py", "sh"],
                output_formats=["ipynb"],
                metadata={},
                compute_types=types,
                default_compute_type=(gpu_types or types or [None])[0],
                utc_only=False,
            )
        ]

    def manage_environments_command(self) -> str:
        return ""

    def output_formats_mapping(self) -> dict[str, str]:
        return {"ipynb": "Notebook"}


class GPULabScheduler(Scheduler):
    """Jobs are the hub's runs (see the module docstring)."""

    @property
    def home(self) -> str:
        return os.path.expanduser("~")

    def _describe(self, run: dict[str, Any]) -> DescribeJob:
        return DescribeJob(**jobmapping.describe(run, root_dir=self.root_dir, home=self.home))

    async def create_job(self, model: CreateJob) -> str:  # type: ignore[override]
        hub = _hub()
        try:
            capacity = await hub.capacity()
            slugs = [str(p["slug"]) for p in capacity["profiles"]]
            body = jobmapping.submit_body(
                model.dict(), root_dir=self.root_dir, home=self.home, profiles=slugs
            )
            run = await hub.submit(body)
        except jobmapping.MappingError as e:
            raise SchedulerError(str(e)) from None
        except HubError as e:
            raise SchedulerError(e.message) from None
        return jobmapping.job_id(int(run["id"]))

    async def list_jobs(self, query: ListJobsQuery) -> ListJobsResponse:  # type: ignore[override]
        if query.job_definition_id:  # the stock scheduler's record of which jobs a schedule made
            return super().list_jobs(query)
        try:
            runs = await _hub().runs()
        except HubError as e:
            raise SchedulerError(e.message) from None
        jobs = [self._describe(r) for r in runs]
        if query.status:
            jobs = [j for j in jobs if j.status == query.status]
        if query.name:
            jobs = [j for j in jobs if j.name.startswith(query.name)]
        if query.start_time:
            jobs = [j for j in jobs if (j.start_time or 0) >= query.start_time]
        for sort in reversed(query.sort_by):
            key = sort.name if sort.name in DescribeJob.__fields__ else "create_time"
            jobs.sort(
                key=lambda j: (getattr(j, key) is None, getattr(j, key) or 0),
                reverse=sort.direction.value == "desc",
            )
        limit = int(query.max_items or len(jobs))
        return ListJobsResponse(jobs=jobs[:limit], total_count=len(jobs))

    async def count_jobs(self, query: CountJobsQuery) -> int:  # type: ignore[override]
        listed = await self.list_jobs(ListJobsQuery(status=query.status))
        return listed.total_count

    async def get_job(self, job_id: str, job_files: bool | None = True) -> DescribeJob:  # type: ignore[override]
        try:
            run = await _hub().run(jobmapping.run_id(job_id))
        except jobmapping.MappingError as e:
            raise SchedulerError(str(e)) from None
        except HubError as e:
            raise SchedulerError(e.message) from None
        return self._describe(run)

    async def stop_job(self, job_id: str) -> None:  # type: ignore[override]
        try:
            await _hub().cancel(jobmapping.run_id(job_id))
        except jobmapping.MappingError as e:
            raise SchedulerError(str(e)) from None
        except HubError as e:
            raise SchedulerError(e.message) from None

    async def delete_job(self, job_id: str) -> None:  # type: ignore[override]
        job = await self.get_job(job_id)
        if job.status in (Status.QUEUED, Status.IN_PROGRESS):
            await self.stop_job(job_id)

    async def update_job(self, job_id: str, model: UpdateJob) -> None:  # type: ignore[override]
        if model.status == Status.STOPPED:
            await self.stop_job(job_id)
            return
        raise SchedulerError(
            "gpulab runs cannot be renamed or moved to another profile once submitted"
        )
