"""Jobs, runs and attempts, and the state machine of a run (immutable values, pure functions).

A job is a definition (``JobSpec``: a notebook or a script in the owner's home, its parameters,
the profile it runs on, its limits); each submission of it is a ``Run``, which goes through the
states below in one or more attempts (``Attempt``). Specs arrive from REST bodies, the CLI and
the lab's submit dialog, so every field is checked here, types included, and each refusal is a
``JobSpecError`` naming the field a client should fix. A run changes only through
``transition(run, event)``, which refuses what the table ``TRANSITIONS`` does not allow.
"""

from __future__ import annotations

import copy
import json
import keyword
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

from gpulab.spawner.names import ENV_PREFIX

from ..allocator import GpuShare, Placement
from ..allocator.units import fmt_gpus

#: What a JSON document holds once parsed: parameters are exactly this, so that they survive the
#: store, a REST round trip and papermill's injection unchanged.
JSONValue: TypeAlias = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]

JobKind = Literal["notebook", "script"]
JOB_KINDS: frozenset[str] = frozenset({"notebook", "script"})

#: A script is run by the interpreter its suffix names (the executors decide which binary).
SCRIPT_SUFFIXES = (".py", ".sh")
NOTEBOOK_SUFFIX = ".ipynb"

#: More than this many retries is a loop, not a policy: a job that failed 11 times will fail again.
MAX_RETRIES = 10
#: Queue priorities run from -PRIORITY_LIMIT to +PRIORITY_LIMIT (higher runs first).
PRIORITY_LIMIT = 1000
#: Parameters are stored with every run and injected into the notebook as source code; a
#: megabyte of them is a data set, which belongs in a file the notebook reads.
MAX_PARAMETERS_BYTES = 64 * 1024
#: Job names appear in output paths and URLs, so they are kept to characters safe in both.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The executors set these from the run's placement and the hub's identity. A submitter who could
# set them would forge both: CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES naming GPUs outside the
# share, MPS or framework caps raised beyond it, a JUPYTERHUB_* token or URL pointing the run's
# hub calls elsewhere, a GPULAB_* variable lying about the share to the caps hook, the monitor or
# the checkpoint code. So they are refused at submission, not silently overwritten later.
RESERVED_ENV_NAMES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "PYTORCH_CUDA_ALLOC_CONF",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
    }
)
RESERVED_ENV_PREFIXES = (ENV_PREFIX, "JUPYTERHUB_", "CUDA_MPS_")


class JobSpecError(ValueError):
    """A job definition was refused; ``field`` names what to fix, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class JobSpec:
    """A job definition, valid by construction (``__post_init__`` raises ``JobSpecError``).

    ``path`` is the notebook (``.ipynb``) or script (``.py``, ``.sh``) relative to the owner's
    home; ``output_dir`` is relative to it too (default ``gpulab-jobs/<name>``) and each run
    writes below it in a directory of its own. Notebooks take ``parameters`` (JSON-typed, injected
    after the cell tagged ``parameters``, papermill's convention); scripts take ``args``.
    ``timeout_seconds`` bounds one attempt (None: the hub's default applies); ``max_retries``
    counts failed and timed-out attempts, not preempted ones. ``profile`` names the hub's GPU
    profile; whether the owner may use it is the hub's check at submission, not this one.
    """

    owner: str
    name: str
    kind: JobKind
    path: str
    profile: str
    groups: frozenset[str] = frozenset()
    parameters: Mapping[str, JSONValue] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    environment: Mapping[str, str] = field(default_factory=dict)
    timeout_seconds: int | None = None
    max_retries: int = 0
    preemptible: bool = False
    priority: int = 0
    output_dir: str = ""

    def __post_init__(self) -> None:
        _check_name("owner", self.owner, pattern=None)
        _check_name("name", self.name, pattern=NAME_PATTERN)
        if self.kind not in JOB_KINDS:
            raise JobSpecError("kind", f"must be 'notebook' or 'script', got {self.kind!r:.80}")
        _set(self, "path", check_relative_path("path", self.path))
        _check_suffix(self.kind, self.path)
        _check_name("profile", self.profile, pattern=None)
        _set(self, "groups", _check_groups(self.groups))
        _set(self, "parameters", _check_parameters(self.kind, self.parameters))
        _set(self, "args", _check_args(self.kind, self.args))
        _set(self, "environment", _check_environment(self.environment))
        if self.timeout_seconds is not None:
            _check_int("timeout_seconds", self.timeout_seconds, low=1, high=None)
        _check_int("max_retries", self.max_retries, low=0, high=MAX_RETRIES)
        if not isinstance(self.preemptible, bool):
            raise JobSpecError(
                "preemptible", f"must be true or false, got {self.preemptible!r:.80}"
            )
        _check_int("priority", self.priority, low=-PRIORITY_LIMIT, high=PRIORITY_LIMIT)
        output_dir = self.output_dir or f"gpulab-jobs/{self.name}"
        _set(self, "output_dir", check_relative_path("output_dir", output_dir))

    def __hash__(self) -> int:
        # the generated hash would hash the parameter and environment mappings and fail
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready values; ``JobSpec.from_dict`` reads it back."""
        return {
            "owner": self.owner,
            "name": self.name,
            "kind": self.kind,
            "path": self.path,
            "profile": self.profile,
            "groups": sorted(self.groups),
            "parameters": copy.deepcopy(dict(self.parameters)),
            "args": list(self.args),
            "environment": dict(self.environment),
            "timeout_seconds": self.timeout_seconds,
            "max_retries": self.max_retries,
            "preemptible": self.preemptible,
            "priority": self.priority,
            "output_dir": self.output_dir,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """A spec from parsed JSON (a REST body with the hub's ``owner`` and ``groups`` added).

        Unknown keys are refused rather than ignored: a misspelt ``max_retires`` would otherwise
        silently run without retries.
        """
        if not isinstance(data, Mapping):
            raise JobSpecError("spec", f"must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise JobSpecError(
                    str(key)[:80], f"unknown field; the fields are {', '.join(sorted(known))}"
                )
        for required in ("owner", "name", "kind", "path", "profile"):
            if required not in data:
                raise JobSpecError(required, "is required")
        values = dict(data)
        if "groups" in values:
            values["groups"] = _as_name_set("groups", values["groups"])
        if "args" in values:
            values["args"] = _as_str_tuple("args", values["args"])
        return cls(**values)


def check_relative_path(field_name: str, value: object) -> str:
    """``value`` as a normalised POSIX path below a directory, or ``JobSpecError``.

    Absolute paths and ``..`` are refused because the executors resolve the path as the owner
    inside her home or a run's output directory, and neither may reach out of it.
    """
    if not isinstance(value, str) or not value:
        raise JobSpecError(field_name, f"must be a non-empty path, got {value!r:.80}")
    if "\0" in value or "\\" in value:
        raise JobSpecError(
            field_name, f"must be a POSIX path without NUL or '\\', got {value!r:.80}"
        )
    path = PurePosixPath(value)
    if path.is_absolute():
        raise JobSpecError(
            field_name, f"must be relative to your home directory, got the absolute {value!r:.80}"
        )
    if ".." in path.parts:
        raise JobSpecError(field_name, f"must not contain '..', got {value!r:.80}")
    if str(path) == ".":
        raise JobSpecError(field_name, f"must name a file or directory, got {value!r:.80}")
    return str(path)


def check_json_value(field_name: str, value: object, depth: int = 0) -> JSONValue:
    """``value`` if it is JSON-typed (finite numbers, string keys), else ``JobSpecError``."""
    if depth > 32:
        raise JobSpecError(field_name, "is nested more than 32 levels deep")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):  # JSON has no NaN or Infinity; the store could not keep it
            raise JobSpecError(field_name, f"must be a finite number, got {value!r}")
        return value
    if isinstance(value, list | tuple):
        return [check_json_value(f"{field_name}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, JSONValue] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise JobSpecError(field_name, f"has a key that is not a string: {key!r:.80}")
            out[key] = check_json_value(f"{field_name}.{key}", item, depth + 1)
        return out
    raise JobSpecError(
        field_name,
        f"must be JSON (null, true/false, a number, a string, a list or an object), "
        f"got a {type(value).__name__}",
    )


def is_reserved_env_name(name: str) -> bool:
    """True for the variables the executors own (placement and hub identity; see above)."""
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def _set(spec: JobSpec, name: str, value: object) -> None:
    object.__setattr__(spec, name, value)


def _check_name(field_name: str, value: object, pattern: re.Pattern[str] | None) -> None:
    if not isinstance(value, str) or not value.strip():
        raise JobSpecError(field_name, f"must be a non-empty string, got {value!r:.80}")
    if pattern is not None and not pattern.fullmatch(value):
        raise JobSpecError(
            field_name,
            "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, "
            f"got {value!r:.80}",
        )


def _check_suffix(kind: str, path: str) -> None:
    if kind == "notebook" and not path.endswith(NOTEBOOK_SUFFIX):
        raise JobSpecError("path", f"a notebook job runs a .ipynb file, got {path!r:.80}")
    if kind == "script" and not path.endswith(SCRIPT_SUFFIXES):
        hint = " (a notebook: submit it with kind 'notebook')" if path.endswith(".ipynb") else ""
        raise JobSpecError("path", f"a script job runs a .py or .sh file, got {path!r:.80}{hint}")


def _as_name_set(field_name: str, raw: object) -> frozenset[str]:
    # frozenset("students") would be a set of letters
    if isinstance(raw, str | bytes) or not isinstance(raw, list | tuple | set | frozenset):
        raise JobSpecError(field_name, f"must be a list of names, got {raw!r:.80}")
    return frozenset(raw)


def _check_groups(raw: object) -> frozenset[str]:
    groups = _as_name_set("groups", raw)
    for group in groups:
        if not isinstance(group, str) or not group:
            raise JobSpecError("groups", f"must hold non-empty names, got {group!r:.80}")
    return groups


def _as_str_tuple(field_name: str, raw: object) -> tuple[str, ...]:
    # a string is a sequence too: "--epochs 3" would become 10 one-letter arguments
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise JobSpecError(field_name, f"must be a list of strings, got {raw!r:.80}")
    return tuple(raw)


def _check_args(kind: str, raw: object) -> tuple[str, ...]:
    args = _as_str_tuple("args", raw)
    for i, arg in enumerate(args):
        if not isinstance(arg, str) or "\0" in arg:
            raise JobSpecError(f"args[{i}]", f"must be a string without NUL, got {arg!r:.80}")
    if args and kind == "notebook":
        raise JobSpecError("args", "a notebook takes parameters, not command-line arguments")
    return args


def _check_parameters(kind: str, raw: object) -> Mapping[str, JSONValue]:
    if not isinstance(raw, Mapping):
        raise JobSpecError("parameters", f"must be a JSON object, got {raw!r:.80}")
    if raw and kind == "script":
        raise JobSpecError("parameters", "a script takes args, not notebook parameters")
    checked: dict[str, JSONValue] = {}
    for key, value in raw.items():
        # papermill assigns each parameter to a variable of that name in the notebook
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            raise JobSpecError(
                "parameters", f"names must be Python variable names, got {key!r:.80}"
            )
        checked[key] = check_json_value(f"parameters.{key}", value)
    if len(json.dumps(checked)) > MAX_PARAMETERS_BYTES:
        raise JobSpecError(
            "parameters",
            f"take more than {MAX_PARAMETERS_BYTES // 1024} KiB as JSON; "
            "put the data in a file and pass its path",
        )
    return MappingProxyType(checked)


def _check_environment(raw: object) -> Mapping[str, str]:
    if not isinstance(raw, Mapping):
        raise JobSpecError("environment", f"must map variable names to strings, got {raw!r:.80}")
    checked: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not ENV_NAME_PATTERN.fullmatch(name):
            raise JobSpecError(
                "environment",
                f"variable names are letters, digits and '_', not starting with a digit; "
                f"got {name!r:.80}",
            )
        if is_reserved_env_name(name):
            raise JobSpecError(
                f"environment.{name}",
                "is set by gpulab from the run's GPU placement and hub identity and cannot be "
                "overridden (reserved: "
                f"{', '.join(sorted(RESERVED_ENV_NAMES))}, {'*, '.join(RESERVED_ENV_PREFIXES)}*)",
            )
        if not isinstance(value, str) or "\0" in value:
            raise JobSpecError(
                f"environment.{name}", f"must be a string without NUL, got {value!r:.80}"
            )
        checked[name] = value
    return MappingProxyType(checked)


def _check_int(field_name: str, value: object, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobSpecError(field_name, f"must be an integer, got {value!r:.80}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise JobSpecError(field_name, f"must be {bounds}, got {value}")
    return value


# -- runs, attempts and their state machine --------------------------------------------------------


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
    process's, where there was one.
    """

    number: int
    admitted_at: float
    placement: PlacementSummary
    started_at: float | None = None
    ended_at: float | None = None
    outcome: RunState | None = None
    exit_code: int | None = None
    reason: str = ""

    @property
    def counts_against_retries(self) -> bool:
        """False for a preempted attempt: the hub took its share back, the job did nothing wrong,
        so a job that is preempted often is not failed for it."""
        return self.outcome is not RunState.PREEMPTED


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
    def counted_attempts(self) -> int:
        """Attempts that count against ``max_retries`` (all but preempted ones)."""
        return sum(1 for a in self.attempts if a.counts_against_retries)

    @property
    def retry_allowed(self) -> bool:
        """Whether ``Retry`` may queue the run again: it ended an attempt in a retryable state
        and, unless it was preempted, used fewer than ``max_retries + 1`` counted attempts."""
        if self.state is RunState.PREEMPTED:
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
    """The attempt could not start or exited with an error."""

    reason: str = "failed"
    exit_code: int | None = None


@dataclass(frozen=True)
class Cancel(Event):
    """Someone canceled the run (its owner, an admin, or the hub for a profile that is gone)."""

    reason: str = "canceled"


@dataclass(frozen=True)
class Preempt(Event):
    """The hub took the share back: a higher-priority request, or the node was lost."""

    reason: str = "preempted"


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
    ended = replace(current, ended_at=event.at, outcome=target, exit_code=exit_code, reason=reason)
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
