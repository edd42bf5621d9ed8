"""Runs, their attempts and the state machine of a run (immutable values, pure functions).

Each submission of a job (``gpulab.hub.jobs.model.JobSpec``) is a ``Run``, which goes through the
states below in one or more attempts (``Attempt``). A run changes only through
``transition(run, event)``, which refuses what the table ``TRANSITIONS`` does not allow.

Who failed an attempt decides whether it counts against ``max_retries``. A job's own failure (an
exit code, a raising cell, a timeout) does. A preemption does not (the hub took the share back).
Nor does a platform failure (``Fail(platform_failure=True)``): the attempt failed before the
job's own code started (its wrapper or kernel did not start, its pod never ran, it was evicted),
which is no fault of the job. Those are retried at most ``PLATFORM_RETRIES`` times a run: a
further one counts as the job's own, so that a platform that never starts a job still ends its
run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..allocator import GpuShare, Placement
from ..allocator.units import fmt_gpus

if TYPE_CHECKING:
    from .model import JobSpec


class RunState(str, Enum):
    """Where a run is. The value is what the store, the REST API and the UI say."""

    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    PREEMPTED = "preempted"
    TIMED_OUT = "timed_out"


#: The run holds a GPU share: whoever moves it out of these states gives the share back.
HOLDING_STATES = frozenset({RunState.ADMITTED, RunState.RUNNING})
#: An attempt ended in one of these; ``Retry`` may queue the run again while retries are left.
RETRYABLE_STATES = frozenset({RunState.FAILED, RunState.PREEMPTED, RunState.TIMED_OUT})
#: Nothing ever follows these.
FINAL_STATES = frozenset({RunState.SUCCEEDED, RunState.CANCELED})
#: A run's platform failures (see the module docstring) that do not count against max_retries;
#: a further one counts as the job's own, so that a run the platform never starts still ends.
PLATFORM_RETRIES = 3


@dataclass(frozen=True)
class PlacementSummary:
    """Where an attempt ran: the node and GPU shares the allocator gave it (kept with the attempt
    so that the history still says so after the allocation is released)."""

    node: str
    gpus: tuple[GpuShare, ...] = ()
    over_quota: bool = False

    @classmethod
    def of(cls, placement: Placement) -> PlacementSummary:
        """The summary of an allocator placement."""
        return cls(placement.node, tuple(placement.gpus), placement.over_quota)

    def describe(self) -> str:
        """``'0.25 GPU on node a1 (a1-gpu0)'``, ``'no GPU on node a1'``: for people."""
        milli = sum(s.milli for s in self.gpus)
        what = fmt_gpus(milli) if milli else "no GPU"
        devices = f" ({', '.join(s.uuid for s in self.gpus)})" if self.gpus else ""
        spot = ", over quota (preempted first)" if self.over_quota else ""
        return f"{what} on node {self.node}{devices}{spot}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values; ``from_dict`` reads them back."""
        return {
            "node": self.node,
            "gpus": [[s.uuid, s.milli] for s in self.gpus],
            "over_quota": self.over_quota,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlacementSummary:
        """The summary ``to_dict`` wrote."""
        gpus = tuple(GpuShare(str(uuid), int(milli)) for uuid, milli in data.get("gpus", ()))
        return cls(str(data["node"]), gpus, bool(data.get("over_quota", False)))


@dataclass(frozen=True)
class Attempt:
    """One try of a run, from its admission (a placement) to its end.

    ``outcome`` is the state the attempt ended in (None while it lasts); ``exit_code`` is the
    process's, where there was one. ``platform_failure``: it failed before the job's own code
    started (the platform's failure, see the module docstring); ``reason`` then says how.
    """

    number: int
    admitted_at: float
    placement: PlacementSummary
    started_at: float | None = None
    ended_at: float | None = None
    outcome: RunState | None = None
    exit_code: int | None = None
    reason: str = ""
    platform_failure: bool = False

    @property
    def counts_against_retries(self) -> bool:
        """False for a preempted attempt (the hub took its share back) and for a platform failure
        (nothing of the job ran): the job did nothing wrong. ``Run.counted_attempts`` counts
        platform failures past ``PLATFORM_RETRIES`` all the same."""
        return self.outcome is not RunState.PREEMPTED and not self.platform_failure


@dataclass(frozen=True)
class Run:
    """One submission of a job. ``priority``, ``max_retries`` and ``timeout_seconds`` are copied
    from the spec at submission, so a run is judged by the rules it was submitted under.

    ``version`` grows by one with every transition; the store compares it (with the state) so
    that a change computed from an outdated copy is refused. ``reason`` is the latest sentence
    about the run for people (why it failed, who canceled it).
    """

    id: int
    job_id: int
    owner: str
    state: RunState
    submitted_at: float
    priority: int = 0
    max_retries: int = 0
    timeout_seconds: int | None = None
    attempts: tuple[Attempt, ...] = ()
    reason: str = ""
    updated_at: float = 0.0
    version: int = 0

    @classmethod
    def submitted(cls, run_id: int, job_id: int, spec: JobSpec, at: float) -> Run:
        """A new queued run of ``spec``."""
        return cls(
            id=run_id,
            job_id=job_id,
            owner=spec.owner,
            state=RunState.QUEUED,
            submitted_at=at,
            priority=spec.priority,
            max_retries=spec.max_retries,
            timeout_seconds=spec.timeout_seconds,
            updated_at=at,
        )

    @property
    def attempt(self) -> Attempt | None:
        """The latest attempt, or None before the first admission."""
        return self.attempts[-1] if self.attempts else None

    @property
    def platform_failures(self) -> int:
        """Attempts that failed before the job's own code started (the platform's failures)."""
        return sum(1 for a in self.attempts if a.platform_failure)

    @property
    def counted_attempts(self) -> int:
        """Attempts that count against ``max_retries``: all but preempted ones and the first
        ``PLATFORM_RETRIES`` platform failures."""
        own = sum(1 for a in self.attempts if a.counts_against_retries)
        return own + max(0, self.platform_failures - PLATFORM_RETRIES)

    @property
    def retry_allowed(self) -> bool:
        """Whether ``Retry`` may queue the run again: it ended an attempt in a retryable state
        and, unless the hub preempted it, used fewer than ``max_retries + 1`` counted attempts
        (a run preempted by the loss of its node is counted as a platform failure)."""
        attempt = self.attempt
        if self.state is RunState.PREEMPTED and (attempt is None or not attempt.platform_failure):
            return True
        return self.state in RETRYABLE_STATES and self.counted_attempts < self.max_retries + 1

    @property
    def is_terminal(self) -> bool:
        """No event can change the run any more."""
        return self.state in FINAL_STATES or (
            self.state in RETRYABLE_STATES and not self.retry_allowed
        )

    @property
    def deadline(self) -> float | None:
        """When the running attempt passes ``timeout_seconds`` (None: not running, no limit)."""
        attempt = self.attempt
        if self.state is not RunState.RUNNING or self.timeout_seconds is None or attempt is None:
            return None
        if attempt.started_at is None:
            return None
        return attempt.started_at + self.timeout_seconds


@dataclass(frozen=True)
class Event:
    """Something that happened to a run at ``at`` (seconds since the epoch)."""

    at: float


@dataclass(frozen=True)
class Admit(Event):
    """The allocator placed the run: an attempt begins and holds ``placement``."""

    placement: PlacementSummary


@dataclass(frozen=True)
class Start(Event):
    """The executor started the attempt's process or Kubernetes Job."""


@dataclass(frozen=True)
class Succeed(Event):
    """The attempt exited with code 0."""


@dataclass(frozen=True)
class Fail(Event):
    """The attempt could not start or exited with an error. ``platform_failure``: it failed
    before the job's own code started, which is not the job's fault (see the module docstring)."""

    reason: str = "failed"
    exit_code: int | None = None
    platform_failure: bool = False


@dataclass(frozen=True)
class Cancel(Event):
    """Someone canceled the run (its owner, an admin, or the hub for a profile that is gone)."""

    reason: str = "canceled"


@dataclass(frozen=True)
class Preempt(Event):
    """The hub took the share back: a higher-priority request, or the node was lost. A lost node
    is the platform's failure (``platform_failure``): not counted against ``max_retries`` either,
    but only ``PLATFORM_RETRIES`` times a run, so that a job whose nodes keep being lost (one that
    takes its node down, say) still ends."""

    reason: str = "preempted"
    platform_failure: bool = False


@dataclass(frozen=True)
class TimeOut(Event):
    """The attempt ran past the run's ``timeout_seconds`` and was stopped."""


@dataclass(frozen=True)
class Retry(Event):
    """Queue the run again after a failed, preempted or timed-out attempt."""


_Q, _A, _R = RunState.QUEUED, RunState.ADMITTED, RunState.RUNNING
_F, _P, _T = RunState.FAILED, RunState.PREEMPTED, RunState.TIMED_OUT

#: (state, event) -> next state. A pair missing here is an illegal transition. Two entries are
#: guarded by ``Run.retry_allowed``: ``Retry`` from a retryable state, and ``Cancel`` from one
#: (a run waiting for its retry may still be canceled; one with no retry left is over already).
TRANSITIONS: Mapping[tuple[RunState, type[Event]], RunState] = MappingProxyType(
    {
        (_Q, Admit): _A,
        (_Q, Cancel): RunState.CANCELED,
        (_A, Start): _R,
        (_A, Fail): _F,  # could not start: the file is gone, the account cannot be made
        (_A, Cancel): RunState.CANCELED,
        (_A, Preempt): _P,
        (_R, Succeed): RunState.SUCCEEDED,
        (_R, Fail): _F,
        (_R, Cancel): RunState.CANCELED,
        (_R, Preempt): _P,
        (_R, TimeOut): _T,
        (_F, Retry): _Q,
        (_P, Retry): _Q,
        (_T, Retry): _Q,
        (_F, Cancel): RunState.CANCELED,
        (_P, Cancel): RunState.CANCELED,
        (_T, Cancel): RunState.CANCELED,
    }
)


class IllegalTransition(Exception):
    """``event`` cannot happen to a run in its state; ``reason`` says why, for logs and 409s."""

    def __init__(self, run: Run, event: Event, reason: str) -> None:
        super().__init__(reason)
        self.run = run
        self.event = event
        self.reason = reason


def allowed_events(run: Run) -> frozenset[type[Event]]:
    """The event types ``transition`` accepts for ``run`` now (a UI enables its buttons by it)."""
    return frozenset(
        kind
        for (state, kind) in TRANSITIONS
        if state is run.state and (state not in RETRYABLE_STATES or run.retry_allowed)
    )


def transition(run: Run, event: Event) -> Run:
    """``run`` after ``event``, or ``IllegalTransition`` when the table or a guard refuses it."""
    kind = type(event)
    target = TRANSITIONS.get((run.state, kind))
    if target is None:
        allowed = sorted(k.__name__ for (s, k) in TRANSITIONS if s is run.state) or ["nothing"]
        raise IllegalTransition(
            run,
            event,
            f"run {run.id} is {run.state.value}: {kind.__name__} is not allowed "
            f"(allowed: {', '.join(allowed)})",
        )
    if run.state in RETRYABLE_STATES and not run.retry_allowed:
        raise IllegalTransition(
            run,
            event,
            f"run {run.id} is {run.state.value} after {run.counted_attempts} attempts, "
            f"the most max_retries={run.max_retries} allows; it will not run again",
        )
    attempts, reason = _attempts_after(run, event, target)
    return replace(
        run,
        state=target,
        attempts=attempts,
        reason=reason,
        updated_at=event.at,
        version=run.version + 1,
    )


def _attempts_after(run: Run, event: Event, target: RunState) -> tuple[tuple[Attempt, ...], str]:
    """The attempts and the run's reason after ``event`` took it to ``target``."""
    attempts = run.attempts
    if isinstance(event, Admit):
        attempt = Attempt(len(attempts) + 1, event.at, event.placement)
        return (*attempts, attempt), ""
    if isinstance(event, Retry):
        return attempts, f"queued again after attempt {len(attempts)} ({run.state.value})"
    current = attempts[-1] if attempts else None
    if isinstance(event, Start):
        assert current is not None  # ADMITTED always has an attempt
        return (*attempts[:-1], replace(current, started_at=event.at)), ""
    reason, exit_code = _ending(run, event)
    # an event that ends an attempt: a run canceled while queued or waiting to retry has none
    if current is None or run.state not in HOLDING_STATES:
        return attempts, reason
    ended = replace(
        current,
        ended_at=event.at,
        outcome=target,
        exit_code=exit_code,
        reason=reason,
        platform_failure=isinstance(event, Fail | Preempt) and event.platform_failure,
    )
    return (*attempts[:-1], ended), reason


def _ending(run: Run, event: Event) -> tuple[str, int | None]:
    if isinstance(event, Succeed):
        return "", 0
    if isinstance(event, Fail):
        return event.reason, event.exit_code
    if isinstance(event, Cancel | Preempt):
        return event.reason, None
    if isinstance(event, TimeOut):
        return f"ran longer than its limit of {run.timeout_seconds} s", None
    raise AssertionError(f"unhandled event {event!r}")  # the table has no other event
