"""GPU jobs: definitions, runs and their state machine, the queue, and the durable store.

The pure core of issue 16 (no JupyterHub, tornado, Kubernetes or traitlets imports). The job
service, its executors and REST handlers build on it::

    from gpulab.hub.jobs import Admit, JobSpec, JobStore, PlacementSummary, RunState, sqlite_url

    store = JobStore(sqlite_url(state_dir))       # or "postgresql://user@host/db"
    run = store.submit(JobSpec(owner="alice", name="train", kind="script",
                               path="train.py", profile="gpu-quarter", args=("--epochs", "3")))
    # admission: place it with the allocator, then compare-and-set; None = another hub won
    won = store.transition(run.id, Admit(now, PlacementSummary.of(placement)),
                           expected_state=RunState.QUEUED)
    if won is None:
        allocator.release(request_id)

Store calls are blocking: from async code, ``await asyncio.to_thread(store.submit, spec)``.
See README.md beside this file.
"""

from .database import SchemaTooNew, make_engine
from .model import (
    FINAL_STATES,
    HOLDING_STATES,
    MAX_RETRIES,
    PLATFORM_RETRIES,
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
    RETRYABLE_STATES,
    TRANSITIONS,
    Admit,
    Attempt,
    Cancel,
    Event,
    Fail,
    IllegalTransition,
    JobKind,
    JobSpec,
    JobSpecError,
    PlacementSummary,
    Preempt,
    Retry,
    Run,
    RunState,
    Start,
    Succeed,
    TimeOut,
    allowed_events,
    is_reserved_env_name,
    transition,
)
from .queue import (
    WaitFacts,
    queue_key,
    queue_order,
    queue_positions,
    quota_holder_short,
    quota_usage,
    share_label,
    waiting_reason,
)
from .store import (
    SCHEMA_VERSION,
    Job,
    JobNotFound,
    JobStore,
    Output,
    sqlite_url,
)

__all__ = [
    "FINAL_STATES",
    "HOLDING_STATES",
    "MAX_RETRIES",
    "PLATFORM_RETRIES",
    "RESERVED_ENV_NAMES",
    "RESERVED_ENV_PREFIXES",
    "RETRYABLE_STATES",
    "SCHEMA_VERSION",
    "TRANSITIONS",
    "Admit",
    "Attempt",
    "Cancel",
    "Event",
    "Fail",
    "IllegalTransition",
    "Job",
    "JobKind",
    "JobNotFound",
    "JobSpec",
    "JobSpecError",
    "JobStore",
    "Output",
    "PlacementSummary",
    "Preempt",
    "Retry",
    "Run",
    "RunState",
    "SchemaTooNew",
    "Start",
    "Succeed",
    "TimeOut",
    "WaitFacts",
    "allowed_events",
    "is_reserved_env_name",
    "make_engine",
    "queue_key",
    "queue_order",
    "queue_positions",
    "quota_holder_short",
    "quota_usage",
    "share_label",
    "sqlite_url",
    "transition",
    "waiting_reason",
]
