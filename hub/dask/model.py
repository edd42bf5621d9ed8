"""Dask GPU clusters and workers, and their state machines (pure values).

The hub owns the cluster (decision record 0003): its scheduler and each of its workers hold an
allocation of their own in the hub's allocator, so workers are admitted one by one under the same
quotas, headroom and priorities as servers and jobs. A cluster and each worker change only
through ``transition_cluster`` / ``transition_worker``, which refuse what ``CLUSTER_TRANSITIONS``
and ``WORKER_TRANSITIONS`` do not allow. The request they start from is ``spec.ClusterSpec``;
their allocation ids and requests are ``allocations``'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType
from typing import Any

from ..jobs.model import PlacementSummary
from .allocations import worker_name

# a Scale, Adapt or SetKeepAlive carries the fields a ClusterSpec has: checked the same way
from .spec import MAX_WORKERS, ClusterSpec, check_adaptive, check_bool, check_int

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
        check_int("n_workers", event.n, 0, MAX_WORKERS)
        changes = {"target": event.n, "minimum": None, "maximum": None}
    elif isinstance(event, Adapt):
        check_adaptive(None, event.minimum, event.maximum)
        changes = {"minimum": event.minimum, "maximum": event.maximum}
    elif isinstance(event, SetKeepAlive):
        check_bool("keep_alive", event.keep_alive)
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
