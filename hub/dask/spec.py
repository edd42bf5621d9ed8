"""The Dask cluster request: ``ClusterSpec``, valid by construction, and its limits.

A cluster is asked for with a ``ClusterSpec`` (from ``gpulab.dask.GPUCluster(...)`` in a notebook,
dask-labextension's sidebar, or the REST API). Every field is checked here, types included, and
a refusal is a ``ClusterSpecError`` naming the field a client should fix, as ``JobSpec`` does.

Apart from ``model`` (clusters and workers and their state machines): what a client may ask for
is checked once, here, before anything is stored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from ..jobs.model import (
    ENV_NAME_PATTERN,
    NAME_PATTERN,
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
    is_reserved_env_name,
)

#: More workers than this in one cluster is a typo (or a denial of service), not a plan: the
#: allocator and the scheduler would each try to place and track every one of them.
MAX_WORKERS = 256
#: An idle timeout shorter than this would stop a cluster between two cells of a notebook.
MIN_IDLE_TIMEOUT_SECONDS = 60
#: A week: an "idle" timeout longer than that is no timeout; the hub may set a lower maximum.
MAX_IDLE_TIMEOUT_SECONDS = 7 * 24 * 3600

# Dask variables the executors set. DASK_DISTRIBUTED__COMM__* carries the cluster's TLS
# credentials and the requirement to use them (the scheduler runs code for whoever connects, so it
# accepts only holders of the cluster's certificate); DASK_SCHEDULER_ADDRESS points a worker at
# its scheduler. A worker started with other values could not join its cluster, or would join
# another: refused at creation, with the variables of JobSpec (placement and hub identity).
DASK_RESERVED_ENV_PREFIXES = ("DASK_DISTRIBUTED__COMM__", "DASK_SCHEDULER_ADDRESS")


class ClusterSpecError(ValueError):
    """A cluster request was refused; ``field`` names what to fix, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ClusterSpec:
    """A Dask cluster request, valid by construction (``__post_init__`` raises
    ``ClusterSpecError``).

    ``owner``, ``groups`` and ``server`` are the hub's record of the caller (the server the
    request came from, "" for the default server), never the request body's. ``profile`` is the
    GPU profile every worker runs on (a fraction such as '1/4 GPU', or whole GPUs). The cluster
    starts with ``n_workers`` workers; with ``minimum`` and ``maximum`` it scales adaptively
    between them instead (both or neither; ``n_workers`` must then lie between them). A cluster
    stops with its server unless ``keep_alive``; either way it stops after
    ``idle_timeout_seconds`` without work (None: the hub's default). ``environment`` is given to
    every worker; the variables gpulab sets are refused. ``preemptible`` workers may be taken
    back for on-demand work (and may run beyond the owner's quota where the hub allows it).
    """

    owner: str
    name: str
    profile: str
    groups: frozenset[str] = frozenset()
    server: str = ""
    n_workers: int = 0
    minimum: int | None = None
    maximum: int | None = None
    keep_alive: bool = False
    idle_timeout_seconds: int | None = None
    environment: Mapping[str, str] = field(default_factory=dict)
    preemptible: bool = False

    def __post_init__(self) -> None:
        _check_text("owner", self.owner)
        _check_name(self.name)
        _check_text("profile", self.profile)
        _set(self, "groups", _check_groups(self.groups))
        if not isinstance(self.server, str) or "/" in self.server:
            raise ClusterSpecError(
                "server", f"must be a server name without '/', got {self.server!r:.80}"
            )
        check_int("n_workers", self.n_workers, 0, MAX_WORKERS)
        check_adaptive(self.n_workers, self.minimum, self.maximum)
        check_bool("keep_alive", self.keep_alive)
        if self.idle_timeout_seconds is not None:
            check_int(
                "idle_timeout_seconds",
                self.idle_timeout_seconds,
                MIN_IDLE_TIMEOUT_SECONDS,
                MAX_IDLE_TIMEOUT_SECONDS,
            )
        _set(self, "environment", _check_environment(self.environment))
        check_bool("preemptible", self.preemptible)

    def __hash__(self) -> int:
        # the generated hash would hash the environment mapping and fail
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def adaptive(self) -> bool:
        """Whether the cluster scales between ``minimum`` and ``maximum`` by itself."""
        return self.maximum is not None

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready values; ``ClusterSpec.from_dict`` reads it back."""
        return {
            "owner": self.owner,
            "name": self.name,
            "profile": self.profile,
            "groups": sorted(self.groups),
            "server": self.server,
            "n_workers": self.n_workers,
            "minimum": self.minimum,
            "maximum": self.maximum,
            "keep_alive": self.keep_alive,
            "idle_timeout_seconds": self.idle_timeout_seconds,
            "environment": dict(self.environment),
            "preemptible": self.preemptible,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """A spec from parsed JSON (a REST body with the hub's ``owner``, ``groups`` and
        ``server`` added). Unknown keys are refused: a misspelt ``keep_alvie`` would otherwise
        silently stop the cluster with its server."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError("spec", f"must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ClusterSpecError(
                    str(key)[:80], f"unknown field; the fields are {', '.join(sorted(known))}"
                )
        for required in ("owner", "name", "profile"):
            if required not in data:
                raise ClusterSpecError(required, "is required")
        values = dict(data)
        if "groups" in values:
            values["groups"] = _as_name_set(values["groups"])
        return cls(**values)


def is_reserved_worker_env_name(name: str) -> bool:
    """True for the variables gpulab sets on a worker (placement, hub identity, Dask comms)."""
    return is_reserved_env_name(name) or name.startswith(DASK_RESERVED_ENV_PREFIXES)


def _set(spec: ClusterSpec, name: str, value: object) -> None:
    object.__setattr__(spec, name, value)


def _check_text(field_name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ClusterSpecError(field_name, f"must be a non-empty string, got {value!r:.80}")


def _check_name(value: object) -> None:
    # a name appears in URLs (the dashboard's), pod and object names and the sidebar
    _check_text("name", value)
    if not NAME_PATTERN.fullmatch(str(value)):
        raise ClusterSpecError(
            "name",
            "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, "
            f"got {value!r:.80}",
        )


def check_bool(field_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ClusterSpecError(field_name, f"must be true or false, got {value!r:.80}")


def check_int(field_name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterSpecError(field_name, f"must be an integer, got {value!r:.80}")
    if not low <= value <= high:
        raise ClusterSpecError(field_name, f"must be between {low} and {high}, got {value}")
    return value


def check_adaptive(n_workers: int | None, minimum: object, maximum: object) -> None:
    if minimum is None and maximum is None:
        return
    if maximum is None:
        raise ClusterSpecError("maximum", "is required with minimum (adaptive scaling)")
    if minimum is None:
        raise ClusterSpecError("minimum", "is required with maximum (adaptive scaling)")
    low = check_int("minimum", minimum, 0, MAX_WORKERS)
    high = check_int("maximum", maximum, 1, MAX_WORKERS)
    if high < low:
        raise ClusterSpecError("maximum", f"must be at least minimum ({low}), got {high}")
    if n_workers is not None and not low <= n_workers <= high:
        raise ClusterSpecError(
            "n_workers",
            f"must lie between minimum and maximum ({low}..{high}) when scaling adaptively, "
            f"got {n_workers}",
        )


def _as_name_set(raw: object) -> frozenset[str]:
    # frozenset("students") would be a set of letters
    if isinstance(raw, str | bytes) or not isinstance(raw, list | tuple | set | frozenset):
        raise ClusterSpecError("groups", f"must be a list of names, got {raw!r:.80}")
    return frozenset(raw)


def _check_groups(raw: object) -> frozenset[str]:
    groups = _as_name_set(raw)
    for group in groups:
        if not isinstance(group, str) or not group:
            raise ClusterSpecError("groups", f"must hold non-empty names, got {group!r:.80}")
    return groups


def _check_environment(raw: object) -> Mapping[str, str]:
    if not isinstance(raw, Mapping):
        raise ClusterSpecError(
            "environment", f"must map variable names to strings, got {raw!r:.80}"
        )
    checked: dict[str, str] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not ENV_NAME_PATTERN.fullmatch(name):
            raise ClusterSpecError(
                "environment",
                "variable names are letters, digits and '_', not starting with a digit; "
                f"got {name!r:.80}",
            )
        if is_reserved_worker_env_name(name):
            prefixes = (*RESERVED_ENV_PREFIXES, *DASK_RESERVED_ENV_PREFIXES)
            raise ClusterSpecError(
                f"environment.{name}",
                "is set by gpulab from the worker's GPU placement, the hub's identity and the "
                "cluster's connection and cannot be overridden (reserved: "
                f"{', '.join(sorted(RESERVED_ENV_NAMES))}, {'*, '.join(prefixes)}*)",
            )
        if not isinstance(value, str) or "\0" in value:
            raise ClusterSpecError(
                f"environment.{name}", f"must be a string without NUL, got {value!r:.80}"
            )
        checked[name] = value
    return MappingProxyType(checked)
