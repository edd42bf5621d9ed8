"""Dask GPU clusters: the spec, clusters and workers, and their state machines (pure values).

A cluster is asked for with a ``ClusterSpec`` (from ``gpulab.dask.GPUCluster(...)`` in a notebook,
dask-labextension's sidebar, or the REST API). Every field is checked here, types included, and
a refusal is a ``ClusterSpecError`` naming the field a client should fix, as ``JobSpec`` does.

The hub owns the cluster (decision record 0003): its scheduler and each of its workers hold an
allocation of their own in the hub's allocator, so workers are admitted one by one under the same
quotas, headroom and priorities as servers and jobs. A cluster and each worker change only
through ``transition_cluster`` / ``transition_worker``, which refuse what ``CLUSTER_TRANSITIONS``
and ``WORKER_TRANSITIONS`` do not allow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from types import MappingProxyType
from typing import Any

from ..allocator import Inventory, Placement, Request
from ..jobs.model import (
    ENV_NAME_PATTERN,
    NAME_PATTERN,
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
    PlacementSummary,
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
        _check_int("n_workers", self.n_workers, 0, MAX_WORKERS)
        _check_adaptive(self.n_workers, self.minimum, self.maximum)
        _check_bool("keep_alive", self.keep_alive)
        if self.idle_timeout_seconds is not None:
            _check_int(
                "idle_timeout_seconds",
                self.idle_timeout_seconds,
                MIN_IDLE_TIMEOUT_SECONDS,
                MAX_IDLE_TIMEOUT_SECONDS,
            )
        _set(self, "environment", _check_environment(self.environment))
        _check_bool("preemptible", self.preemptible)

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


def _check_bool(field_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ClusterSpecError(field_name, f"must be true or false, got {value!r:.80}")


def _check_int(field_name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterSpecError(field_name, f"must be an integer, got {value!r:.80}")
    if not low <= value <= high:
        raise ClusterSpecError(field_name, f"must be between {low} and {high}, got {value}")
    return value


def _check_adaptive(n_workers: int | None, minimum: object, maximum: object) -> None:
    if minimum is None and maximum is None:
        return
    if maximum is None:
        raise ClusterSpecError("maximum", "is required with minimum (adaptive scaling)")
    if minimum is None:
        raise ClusterSpecError("minimum", "is required with maximum (adaptive scaling)")
    low = _check_int("minimum", minimum, 0, MAX_WORKERS)
    high = _check_int("maximum", maximum, 1, MAX_WORKERS)
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


# -- allocation ids --------------------------------------------------------------------------------

_ALLOCATION = re.compile(
    r"(?P<owner>.+)/dask-(?P<cluster>[0-9]+)-(?P<part>scheduler|w[0-9]+)", re.DOTALL
)


def worker_allocation_id(owner: str, cluster_id: int, number: int) -> str:
    """``alice/dask-7-w3``: the allocation of worker 3 of cluster 7. Worker numbers are never
    reused within a cluster, so an id names one worker for good (after a hub restart too)."""
    return f"{owner}/dask-{cluster_id}-w{number}"


def scheduler_allocation_id(owner: str, cluster_id: int) -> str:
    """``alice/dask-7-scheduler``: the scheduler's allocation (CPU and memory, no GPU)."""
    return f"{owner}/dask-{cluster_id}-scheduler"


@dataclass(frozen=True)
class DaskAllocation:
    """What a Dask allocation id names: the owner, the cluster and the worker (None: the
    scheduler)."""

    owner: str
    cluster_id: int
    worker: int | None


def parse_allocation_id(allocation: str) -> DaskAllocation | None:
    """The parts of a Dask allocation id; None for any other allocation (a server's, a job's)."""
    match = _ALLOCATION.fullmatch(allocation)
    if match is None:
        return None
    part = match["part"]
    worker = None if part == "scheduler" else int(part[1:])
    return DaskAllocation(match["owner"], int(match["cluster"]), worker)


def worker_name(number: int) -> str:
    """The worker's name in its scheduler and dashboard (``w3``); the scheduler's
    ``workers_to_close(attribute="name")`` answers with these."""
    return f"w{number}"


@dataclass(frozen=True)
class NearNotebook:
    """Where a cluster's notebook runs, as the allocator's soft preference for its workers
    (decision 0003, "Placement next to the notebook"): its node, and the NVLink group of its
    first GPU on that node (None: no GPU, or GPUs without NVLink)."""

    node: str
    nvlink_group: str | None = None


def near_notebook(
    notebook: Placement | PlacementSummary | None, inventory: Inventory
) -> NearNotebook | None:
    """The preference for workers of a notebook placed at ``notebook`` (None: the notebook holds
    no allocation, so there is nothing to be near). A node or GPU the inventory no longer has
    still names the node: the allocator passes over a preferred node it does not know."""
    if notebook is None:
        return None
    index = inventory.index_of(notebook.node)
    if index is None or not notebook.gpus:
        return NearNotebook(notebook.node)
    groups = {gpu.uuid: gpu.nvlink_group for gpu in inventory.nodes[index].gpus}
    return NearNotebook(notebook.node, groups.get(notebook.gpus[0].uuid))


def worker_request(
    base: Request,
    *,
    owner: str,
    cluster_id: int,
    number: int,
    preemptible: bool,
    affinity_group: str | None,
    near: NearNotebook | None = None,
) -> Request:
    """The allocator request of one worker: the profile's request (``base``, from the hub's
    ``GPUCapacity.request_for``) under the worker's allocation id, with the notebook's affinity
    group so that workers land next to it where the allocator can, and preemptible when the
    cluster asked for it whatever the profile says.

    ``near`` (see ``near_notebook``) makes the notebook's node, then its rack, the first choice,
    and on that node the notebook's NVLink group; soft: a full node is passed over, never a
    refusal. A preference in ``base`` is replaced, so a profile cannot steer workers elsewhere.
    """
    return replace(
        base,
        id=worker_allocation_id(owner, cluster_id, number),
        owner=owner,
        priority="preemptible" if preemptible else base.priority,
        affinity_group=affinity_group,
        preferred_node=near.node if near is not None else None,
        preferred_nvlink_group=near.nvlink_group if near is not None else None,
    )


def scheduler_request(
    owner: str,
    groups: frozenset[str],
    cluster_id: int,
    *,
    cpu_milli: int,
    memory_mib: int,
    affinity_group: str | None,
) -> Request:
    """The scheduler's allocator request: CPU and memory only (it runs no GPU code), so that
    the allocator's CPU and memory accounting stays true; it counts against no GPU quota."""
    return Request(
        id=scheduler_allocation_id(owner, cluster_id),
        owner=owner,
        groups=groups,
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        affinity_group=affinity_group,
    )


def uses_dask_cuda(placement: Placement | PlacementSummary) -> bool:
    """Whether a worker on ``placement`` runs dask-cuda's worker (it holds a GPU share) or a
    plain ``distributed`` worker (a CPU-only profile)."""
    return bool(placement.gpus)


# -- clusters and their state machine -----------------------------------------------------------


class ClusterState(str, Enum):
    """Where a cluster is. The value is what the store, the REST API and the sidebar say."""

    PENDING = "pending"  # created; its scheduler waits for a place
    STARTING = "starting"  # the scheduler is placed and starting
    RUNNING = "running"  # the scheduler answers at ``scheduler_address``
    STOPPING = "stopping"  # workers and scheduler are being stopped
    STOPPED = "stopped"
    FAILED = "failed"


#: The cluster is alive: it may be scaled, and its name is taken.
LIVE_CLUSTER_STATES = frozenset({ClusterState.PENDING, ClusterState.STARTING, ClusterState.RUNNING})
#: The scheduler holds its allocation: whoever moves the cluster out of these releases it.
SCHEDULER_HOLDING_STATES = frozenset(
    {ClusterState.STARTING, ClusterState.RUNNING, ClusterState.STOPPING}
)
#: Nothing of the cluster runs, nothing follows.
FINAL_CLUSTER_STATES = frozenset({ClusterState.STOPPED, ClusterState.FAILED})


@dataclass(frozen=True)
class Cluster:
    """A stored cluster. ``target`` is the worker count asked for by hand; ``minimum`` and
    ``maximum`` are set while it scales adaptively (``adapt``), and then the scheduler's own
    target, kept between them, applies instead. ``keep_alive`` may change while it lives (the
    sidebar's toggle). ``failed`` says how a stopping cluster will end. ``version`` grows by one
    with every transition; the store compares it (with the state) so that a change computed from
    an outdated copy is refused."""

    id: int
    spec: ClusterSpec
    state: ClusterState
    created_at: float
    target: int
    minimum: int | None = None
    maximum: int | None = None
    keep_alive: bool = False
    scheduler: PlacementSummary | None = None
    scheduler_address: str = ""
    dashboard_url: str = ""
    reason: str = ""
    failed: bool = False
    updated_at: float = 0.0
    version: int = 0

    @classmethod
    def created(cls, cluster_id: int, spec: ClusterSpec, at: float) -> Cluster:
        """A new pending cluster of ``spec``."""
        return cls(
            id=cluster_id,
            spec=spec,
            state=ClusterState.PENDING,
            created_at=at,
            target=spec.n_workers,
            minimum=spec.minimum,
            maximum=spec.maximum,
            keep_alive=spec.keep_alive,
            updated_at=at,
        )

    @property
    def owner(self) -> str:
        return self.spec.owner

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def adaptive(self) -> bool:
        return self.maximum is not None

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_CLUSTER_STATES


@dataclass(frozen=True)
class ClusterEvent:
    """Something that happened to a cluster at ``at`` (seconds since the epoch)."""

    at: float


@dataclass(frozen=True)
class Launch(ClusterEvent):
    """The allocator placed the scheduler; the executor starts it."""

    placement: PlacementSummary


@dataclass(frozen=True)
class Ready(ClusterEvent):
    """The scheduler answers; clients and workers connect to ``address``."""

    address: str
    dashboard_url: str = ""


@dataclass(frozen=True)
class Scale(ClusterEvent):
    """Scale by hand to ``n`` workers (ends adaptive scaling)."""

    n: int


@dataclass(frozen=True)
class Adapt(ClusterEvent):
    """Scale adaptively between ``minimum`` and ``maximum`` workers."""

    minimum: int
    maximum: int


@dataclass(frozen=True)
class SetKeepAlive(ClusterEvent):
    """Keep the cluster when its server stops (True), or stop it with the server (False)."""

    keep_alive: bool


@dataclass(frozen=True)
class Stop(ClusterEvent):
    """Stop the cluster (its owner, its server stopping, the idle timeout, or a failure:
    ``failed``); workers and scheduler are being stopped."""

    reason: str = "stopped by its owner"
    failed: bool = False


@dataclass(frozen=True)
class Stopped(ClusterEvent):
    """Nothing of the cluster runs any more; its allocations are released."""


_P, _S, _R, _X = (
    ClusterState.PENDING,
    ClusterState.STARTING,
    ClusterState.RUNNING,
    ClusterState.STOPPING,
)

#: (state, event) -> next state. A pair missing here is an illegal transition. A stopping cluster
#: ends as failed when the ``Stop`` that began it said so, else as stopped (``Cluster.failed``).
CLUSTER_TRANSITIONS: Mapping[tuple[ClusterState, type[ClusterEvent]], ClusterState] = (
    MappingProxyType(
        {
            (_P, Launch): _S,
            (_S, Ready): _R,
            **{(s, Scale): s for s in (_P, _S, _R)},
            **{(s, Adapt): s for s in (_P, _S, _R)},
            **{(s, SetKeepAlive): s for s in (_P, _S, _R)},
            **{(s, Stop): _X for s in (_P, _S, _R)},
            (_X, Stopped): ClusterState.STOPPED,
        }
    )
)


class IllegalTransition(Exception):
    """An event cannot happen to a cluster or worker in its state; ``reason`` says why (for
    logs and 409s)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def transition_cluster(cluster: Cluster, event: ClusterEvent) -> Cluster:
    """``cluster`` after ``event``, or ``IllegalTransition``."""
    kind = type(event)
    target = CLUSTER_TRANSITIONS.get((cluster.state, kind))
    if target is None:
        allowed = sorted(k.__name__ for (s, k) in CLUSTER_TRANSITIONS if s is cluster.state)
        raise IllegalTransition(
            f"cluster {cluster.name!r} is {cluster.state.value}: {kind.__name__} is not allowed "
            f"(allowed: {', '.join(allowed) or 'nothing'})"
        )
    changes: dict[str, Any] = {}
    if isinstance(event, Launch):
        changes = {"scheduler": event.placement, "reason": ""}
    elif isinstance(event, Ready):
        changes = {"scheduler_address": event.address, "dashboard_url": event.dashboard_url}
    elif isinstance(event, Scale):
        _check_int("n_workers", event.n, 0, MAX_WORKERS)
        changes = {"target": event.n, "minimum": None, "maximum": None}
    elif isinstance(event, Adapt):
        _check_adaptive(None, event.minimum, event.maximum)
        changes = {"minimum": event.minimum, "maximum": event.maximum}
    elif isinstance(event, SetKeepAlive):
        _check_bool("keep_alive", event.keep_alive)
        changes = {"keep_alive": event.keep_alive}
    elif isinstance(event, Stop):
        changes = {"reason": event.reason, "failed": event.failed}
    elif isinstance(event, Stopped) and cluster.failed:
        target = ClusterState.FAILED
    return replace(
        cluster, state=target, updated_at=event.at, version=cluster.version + 1, **changes
    )


# -- workers and their state machine --------------------------------------------------------------


class WorkerState(str, Enum):
    """Where one worker is."""

    PENDING = "pending"  # wanted; waits for a place or for quota (``reason`` says which)
    ADMITTED = "admitted"  # placed (its allocation held); its process or pod is starting
    RUNNING = "running"  # connected to the scheduler
    RETIRING = "retiring"  # asked to leave: its data moves away, then it stops
    STOPPED = "stopped"
    FAILED = "failed"  # could not start, or died
    PREEMPTED = "preempted"  # its share was taken back for on-demand work


#: Workers that count toward the cluster's worker count (scaling compares them with the target).
ACTIVE_WORKER_STATES = frozenset({WorkerState.PENDING, WorkerState.ADMITTED, WorkerState.RUNNING})
#: The worker holds its allocation: whoever moves it out of these releases it, once nothing of
#: it runs (never before: the share would be handed out while the worker still uses it).
HOLDING_WORKER_STATES = frozenset({WorkerState.ADMITTED, WorkerState.RUNNING, WorkerState.RETIRING})
FINAL_WORKER_STATES = frozenset({WorkerState.STOPPED, WorkerState.FAILED, WorkerState.PREEMPTED})


@dataclass(frozen=True)
class Worker:
    """One worker of a cluster. ``number`` counts from 1 within its cluster and is never
    reused; ``placement`` is set from its admission on (and kept after it ends, for the
    history)."""

    cluster_id: int
    number: int
    state: WorkerState
    created_at: float
    placement: PlacementSummary | None = None
    reason: str = ""
    updated_at: float = 0.0
    version: int = 0

    @property
    def name(self) -> str:
        return worker_name(self.number)

    @property
    def over_quota(self) -> bool:
        """A preemptible worker admitted beyond its owner's budget (retired and preempted
        first)."""
        return self.placement is not None and self.placement.over_quota


@dataclass(frozen=True)
class WorkerEvent:
    """Something that happened to a worker at ``at``."""

    at: float


@dataclass(frozen=True)
class AdmitWorker(WorkerEvent):
    """The allocator placed the worker."""

    placement: PlacementSummary


@dataclass(frozen=True)
class Wait(WorkerEvent):
    """The worker still waits; ``reason`` says for what ("waiting for a free 1/4 GPU")."""

    reason: str


@dataclass(frozen=True)
class Joined(WorkerEvent):
    """The worker connected to its scheduler."""


@dataclass(frozen=True)
class Retire(WorkerEvent):
    """Scale down: a pending worker is dropped at once; a placed one is asked to leave."""

    reason: str = "scaled down"


@dataclass(frozen=True)
class Exited(WorkerEvent):
    """A retiring worker's process or pod is gone."""


@dataclass(frozen=True)
class WorkerFailed(WorkerEvent):
    """The worker could not start, or it died; nothing of it runs."""

    reason: str = "failed"


@dataclass(frozen=True)
class Preempted(WorkerEvent):
    """The worker's share was taken back for on-demand work; nothing of it runs."""

    reason: str = "preempted"


_WP, _WA, _WR, _WX = (
    WorkerState.PENDING,
    WorkerState.ADMITTED,
    WorkerState.RUNNING,
    WorkerState.RETIRING,
)

#: (state, event) -> next state; a pair missing here is an illegal transition.
WORKER_TRANSITIONS: Mapping[tuple[WorkerState, type[WorkerEvent]], WorkerState] = MappingProxyType(
    {
        (_WP, AdmitWorker): _WA,
        (_WP, Wait): _WP,
        (_WP, Retire): WorkerState.STOPPED,  # it held nothing
        (_WA, Joined): _WR,
        (_WA, Retire): _WX,
        (_WR, Retire): _WX,
        (_WX, Exited): WorkerState.STOPPED,
        **{(s, WorkerFailed): WorkerState.FAILED for s in (_WA, _WR, _WX)},
        **{(s, Preempted): WorkerState.PREEMPTED for s in (_WA, _WR, _WX)},
    }
)


def transition_worker(worker: Worker, event: WorkerEvent) -> Worker:
    """``worker`` after ``event``, or ``IllegalTransition``."""
    kind = type(event)
    target = WORKER_TRANSITIONS.get((worker.state, kind))
    if target is None:
        allowed = sorted(k.__name__ for (s, k) in WORKER_TRANSITIONS if s is worker.state)
        raise IllegalTransition(
            f"worker {worker.name} of cluster {worker.cluster_id} is {worker.state.value}: "
            f"{kind.__name__} is not allowed (allowed: {', '.join(allowed) or 'nothing'})"
        )
    changes: dict[str, Any] = {"reason": ""}
    if isinstance(event, AdmitWorker):
        changes["placement"] = event.placement
    elif isinstance(event, Wait | Retire | WorkerFailed | Preempted):
        changes["reason"] = event.reason
    elif isinstance(event, Exited):
        changes["reason"] = worker.reason  # why it retired stays the worker's last word
    return replace(worker, state=target, updated_at=event.at, version=worker.version + 1, **changes)
