"""What the GPU-hour ledger records: one interval per share of one device held by an allocation.

A placement of two whole GPUs is two intervals (one per device, 1000 milli each); a quarter of a
GPU is one interval of 250 milli; a MIG instance is one interval of what the allocator took on
it (its capacity). An interval opens when the allocator grants the share and closes when it is
released, preempted or resized (then a new one opens), or when it is found gone (its node lost,
its pod deleted while the hub was down). Times are whole seconds since the epoch.

`diff` is the one rule that turns "what the allocator holds now" into ledger writes; every
writer (grant, release, preemption, resize, the periodic and start-up reconciliation) goes
through it, so the ledger can only ever disagree with the allocator for the time between a
change and its write.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

#: kinds of workload an interval can belong to; "external" is a GPU pod gpulab did not make,
#: "warm" a warm pool member's reservation (gpulab's own overhead, owned by the pool's account)
WORKLOADS = ("server", "job", "dask", "external", "warm")
#: the workloads whose GPU use is measured: a server's GPU monitor pushes its share's
#: utilisation to gpulab-metrics, and so do a job run's wrapper and a Dask worker's preload (with
#: the report token the hub issues each, gpulab.hub.report_tokens). External pods run nothing of
#: ours, so their used and idle GPU-hours are unknown, and rollups count their allocated hours as
#: "unmonitored" instead of calling all of them idle.
MONITORED_WORKLOADS = ("server", "job", "dask")

#: why an interval closed: released by its holder, preempted (for on-demand work, or by an
#: admin), resized, gone (found missing without a release), its node lost, culled (GPU-aware
#: culling), budget (a GPU-hour budget used up), handed-over (a warm pool member's reservation
#: that became the share of the user who claimed it: her interval starts as it ends)
RELEASED, PREEMPTED, RESIZED, GONE, NODE_LOST, CULLED, BUDGET, HANDED_OVER = (
    "released",
    "preempted",
    "resized",
    "gone",
    "node-lost",
    "culled",
    "budget",
    "handed-over",
)
END_REASONS = (RELEASED, PREEMPTED, RESIZED, GONE, NODE_LOST, CULLED, BUDGET, HANDED_OVER)

MILLI = 1000


def whole_second(t: float) -> int:
    """The ledger's resolution: the nearest whole second (a grant and its release at 10.6 and
    10.9 make a zero-length interval, not a negative one)."""
    return int(math.floor(t + 0.5))


@dataclass(frozen=True)
class Holding:
    """One share of one device that an allocation holds now, with what the ledger reports it by."""

    allocation_id: str
    device: str  # the GPU's (or MIG instance's) uuid
    user: str
    groups: tuple[str, ...]
    workload: str
    profile: str
    gpu_model: str
    mig_profile: str | None
    node: str
    milli: int
    tier: str  # "on-demand" | "preemptible"

    @property
    def key(self) -> tuple[str, str]:
        return (self.allocation_id, self.device)

    @property
    def fraction(self) -> float:
        return self.milli / MILLI


@dataclass(frozen=True)
class Interval:
    """A closed or open stretch of one holding: ``end`` None while it is held."""

    id: int
    holding: Holding
    start: int
    end: int | None = None
    end_reason: str | None = None

    @property
    def open(self) -> bool:
        return self.end is None

    def milli_seconds(self, since: int, until: int) -> int:
        """Milli-GPU x seconds held within [since, until) (an open interval counts to `until`)."""
        end = until if self.end is None else min(self.end, until)
        start = max(self.start, since)
        return self.holding.milli * max(0, end - start)

    def to_json(self) -> dict[str, Any]:
        h = self.holding
        return {
            "id": self.id,
            "allocation_id": h.allocation_id,
            "user": h.user,
            "groups": list(h.groups),
            "workload": h.workload,
            "profile": h.profile,
            "gpu_model": h.gpu_model,
            "mig_profile": h.mig_profile,
            "node": h.node,
            "device": h.device,
            "fraction": h.fraction,
            "tier": h.tier,
            "start": self.start,
            "end": self.end,
            "end_reason": self.end_reason,
        }


@dataclass(frozen=True)
class DeviceInfo:
    """What the ledger needs to know of a device: its model and MIG profile."""

    model: str
    mig_profile: str | None = None


def workload_of(allocation_id: str, workload: str | None) -> str:
    """The request's own label, else what its id says (allocations made before requests carried
    one: "{owner}/job-{n}" is a job, "external/..." a pod gpulab did not make)."""
    if workload:
        return workload
    if allocation_id.startswith("external/"):
        return "external"
    _, _, name = allocation_id.partition("/")
    if name.startswith("job-") and name[4:].isdigit():
        return "job"
    if name.startswith("dask-"):
        return "dask"
    return "server"


def holdings(
    allocation_id: str,
    request: Any,
    node: str,
    shares: Iterable[tuple[str, int]],
    device: Callable[[str], DeviceInfo | None],
) -> list[Holding]:
    """The holdings of one placement (`request` an allocator Request; `shares` its (uuid,
    milli) pairs); `device(uuid)` looks a device up, None when the inventory no longer has it."""
    out = []
    for uuid, milli in shares:
        info = device(uuid) or DeviceInfo(model="unknown")
        out.append(
            Holding(
                allocation_id=allocation_id,
                device=uuid,
                user=request.owner or "",
                groups=tuple(sorted(request.groups)),
                workload=workload_of(allocation_id, getattr(request, "workload", None)),
                profile=getattr(request, "profile", None) or "",
                gpu_model=info.model,
                mig_profile=info.mig_profile,
                node=node,
                milli=int(milli),
                tier=request.priority,
            )
        )
    return out


@dataclass(frozen=True)
class Change:
    """Ledger writes: intervals to close (id, end, reason) and holdings to open at `start`."""

    close: tuple[tuple[int, int, str], ...] = ()
    open: tuple[tuple[Holding, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.close or self.open)


def diff(
    open_intervals: Iterable[Interval],
    now_held: Iterable[Holding],
    t: int,
    *,
    reasons: Mapping[str, str] | None = None,
    default_reason: str = RELEASED,
    live_nodes: frozenset[str] | None = None,
    started: Mapping[str, int] | None = None,
) -> Change:
    """What to write so that the open intervals are exactly `now_held` from time `t` on.

    An open interval whose holding is gone closes at `t` with `reasons[allocation_id]` (e.g.
    "preempted"), else "node-lost" when `live_nodes` is given and lacks its node, else
    `default_reason`. A holding that changed (another share size, tier, profile: a resize)
    closes with "resized" and reopens at `t`. A new holding opens at `started[allocation_id]`
    when given (the allocator's own grant time, so a reconciliation after a restart does not
    lose the time before it) unless something on its device closes in the same write, else at
    `t`. (The store also never opens one before the last end of the same share.)
    """
    reasons = reasons or {}
    started = started or {}
    wanted: dict[tuple[str, str], Holding] = {h.key: h for h in now_held}
    close: list[tuple[int, int, str]] = []
    opened_at: dict[tuple[str, str], int] = {}
    kept: set[tuple[str, str]] = set()
    for interval in open_intervals:
        key = interval.holding.key
        now = wanted.get(key)
        if now is not None and key not in kept and _same(now, interval.holding):
            kept.add(key)
            continue
        if now is not None:
            reason = RESIZED
        elif key[0] in reasons:
            reason = reasons[key[0]]
        elif live_nodes is not None and interval.holding.node not in live_nodes:
            reason = NODE_LOST
        else:
            reason = default_reason
        end = max(t, interval.start)
        close.append((interval.id, end, reason))
        opened_at[key] = max(opened_at.get(key, end), end)
    # A share found held without an open interval (its grant's write was lost) is dated back to
    # its grant, unless this write also ends something on the same device: that one's true end
    # is unknown (only that it came before now), so dating the newcomer back could count the
    # device twice over. It then starts now, like the end it replaces.
    closed_devices = {device for _, device in opened_at}
    to_open = []
    for key, holding in wanted.items():
        if key in kept:
            continue
        start = t
        if key[0] in started and key[1] not in closed_devices:
            start = min(t, whole_second(started[key[0]]))
        to_open.append((holding, start))
    return Change(tuple(close), tuple(to_open))


def _same(a: Holding, b: Holding) -> bool:
    """Whether an open interval still describes the holding (its groups may change without a
    new interval: a user's group membership is not a property of the share)."""
    return replace(a, groups=()) == replace(b, groups=())
