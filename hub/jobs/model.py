"""Job definitions (immutable values, pure functions); runs and their state machine are in
``gpulab.hub.jobs.runs`` (re-exported here, where the executors have always imported them).

A job is a definition (``JobSpec``: a notebook or a script in the owner's home, its parameters,
the profile it runs on, its limits); each submission of it is a ``Run``. Specs arrive from REST
bodies, the CLI and the lab's submit dialog, so every field is checked here, types included, and
each refusal is a ``JobSpecError`` naming the field a client should fix.
"""

from __future__ import annotations

import copy
import json
import keyword
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

from gpulab.spawner.names import ENV_PREFIX

from .runs import (
    FINAL_STATES,
    HOLDING_STATES,
    PLATFORM_RETRIES,
    RETRYABLE_STATES,
    TRANSITIONS,
    Admit,
    Attempt,
    Cancel,
    Event,
    Fail,
    IllegalTransition,
    PlacementSummary,
    Preempt,
    Retry,
    Run,
    RunState,
    Start,
    Succeed,
    TimeOut,
    allowed_events,
    transition,
)

__all__ = [
    "FINAL_STATES",
    "HOLDING_STATES",
    "JOB_KINDS",
    "MAX_RETRIES",
    "PLATFORM_RETRIES",
    "RESERVED_ENV_NAMES",
    "RESERVED_ENV_PREFIXES",
    "RETRYABLE_STATES",
    "TRANSITIONS",
    "Admit",
    "Attempt",
    "Cancel",
    "Event",
    "Fail",
    "IllegalTransition",
    "JSONValue",
    "JobKind",
    "JobSpec",
    "JobSpecError",
    "PlacementSummary",
    "Preempt",
    "Retry",
    "Run",
    "RunState",
    "Start",
    "Succeed",
    "TimeOut",
    "allowed_events",
    "check_json_value",
    "check_relative_path",
    "is_reserved_env_name",
    "transition",
]

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
