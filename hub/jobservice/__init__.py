"""The hub's job service (issue 16): `JobService` (queue, admission through the hub's allocator,
execution, cancel, recovery after a restart) and the executor contract backends implement
(`JobExecutor`). The pure core it builds on (specs, runs, the state machine, the store) is
`gpulab.hub.jobs`."""

from .executor import Handle, JobExecutor, JobOutcome
from .service import JobRefused, JobService, allocation_id

__all__ = ["Handle", "JobExecutor", "JobOutcome", "JobRefused", "JobService", "allocation_id"]
