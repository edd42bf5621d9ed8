"""Scaling decisions: how many workers a cluster should have, which to add, which to retire.

Pure: the cluster service brings what only the running hub and the scheduler know (the
scheduler's adaptive target, its ``workers_to_close`` suggestion, the owner's quota left) and
gets back a plan. Every worker the plan adds is admitted on its own through the allocator, so
manual and adaptive scaling meet the same quotas, headroom and priorities as a notebook server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..allocator.units import fmt_gpus
from .model import ACTIVE_WORKER_STATES, Cluster, Worker, WorkerState


@dataclass(frozen=True)
class ScalePlan:
    """``add`` new (pending) workers, and retire the workers numbered ``retire``, in that order.
    Never both: a cluster grows or shrinks in one pass."""

    add: int = 0
    retire: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.add and not self.retire


def active(workers: Iterable[Worker]) -> list[Worker]:
    """The workers that count toward the cluster's size (pending, admitted, running)."""
    return [w for w in workers if w.state in ACTIVE_WORKER_STATES]


def most_workers_within(left_milli: int | None, worker_milli: int) -> int | None:
    """How many more workers of ``worker_milli`` each the budget ``left_milli`` admits (None:
    no limit, for an unlimited owner or a worker without GPU)."""
    if left_milli is None or worker_milli <= 0:
        return None
    return max(0, left_milli) // worker_milli


def desired_count(cluster: Cluster, current: int, scheduler_target: int | None) -> int:
    """The worker count to scale to: the manual ``target``, or, while adaptive, the scheduler's
    own target (``Scheduler.adaptive_target``; None before the scheduler answers: the
    ``current`` count) kept between ``minimum`` and ``maximum``."""
    if cluster.maximum is None:
        return cluster.target
    minimum = cluster.minimum or 0
    wanted = current if scheduler_target is None else scheduler_target
    return max(minimum, min(cluster.maximum, wanted))


def adaptive_within_quota(
    desired: int, workers: Iterable[Worker], room: int | None, minimum: int
) -> int:
    """An adaptive target no higher than the quota admits: the placed workers plus ``room``
    more (``most_workers_within``), so adaptive scaling asks for no worker that could only wait
    for quota. ``minimum`` stays (it was checked against the whole quota when it was set; its
    workers wait for quota the owner's other work holds, with that reason)."""
    if room is None:
        return desired
    placed = sum(1 for w in workers if w.state in (WorkerState.ADMITTED, WorkerState.RUNNING))
    return max(minimum, min(desired, placed + room))


def quota_refusal(
    *,
    n: int,
    worker_milli: int,
    left_milli: int | None,
    held_milli: int = 0,
    limit: str = "your GPU quota",
) -> str | None:
    """Why ``n`` workers of ``worker_milli`` each cannot all be within the budget, naming the
    limit and the most that fit; None when they can (or nothing limits them).

    ``left_milli`` is the quota left now (``Allocator.quota_left_milli``); ``held_milli`` is
    what this cluster's placed workers hold already: they stay, so their share counts as room.
    A manual scale that this refuses is refused whole (a 403, nothing changed), not admitted in
    part: the caller asked for a number and would otherwise get fewer without being told.
    """
    if left_milli is None or worker_milli <= 0:
        return None
    budget = max(0, left_milli) + held_milli
    need = n * worker_milli
    if need <= budget:
        return None
    most = budget // worker_milli
    return (
        f"{n} workers of {fmt_gpus(worker_milli)} need {fmt_gpus(need)}, more than the "
        f"{fmt_gpus(budget)} {limit} leaves for this cluster: at most {most} "
        f"worker{'' if most == 1 else 's'}"
    )


def retire_order(workers: Iterable[Worker], close_first: Sequence[str] = ()) -> list[Worker]:
    """The active workers in the order to retire them.

    Pending workers first (they hold nothing), then admitted ones that have not joined (they
    computed nothing), then running ones: preemptible workers over quota first (they run on
    borrowed capacity and would be preempted first anyway), then in the scheduler's
    ``workers_to_close`` order (``close_first``, worker names: it picks those whose data is
    cheapest to move), then the youngest.
    """
    stage = {WorkerState.PENDING: 0, WorkerState.ADMITTED: 1, WorkerState.RUNNING: 2}
    rank = {name: i for i, name in enumerate(close_first)}

    def key(w: Worker) -> tuple[int, bool, int, int]:
        return (stage[w.state], not w.over_quota, rank.get(w.name, len(rank)), -w.number)

    return sorted(active(workers), key=key)


def plan_scale(
    workers: Iterable[Worker], target: int, close_first: Sequence[str] = ()
) -> ScalePlan:
    """What brings the active workers to ``target``: new workers to add, or which to retire
    (``retire_order``)."""
    if target < 0:
        raise ValueError(f"a worker target is >= 0, got {target}")
    current = active(workers)
    if len(current) < target:
        return ScalePlan(add=target - len(current))
    surplus = len(current) - target
    if not surplus:
        return ScalePlan()
    order = retire_order(current, close_first)
    return ScalePlan(retire=tuple(w.number for w in order[:surplus]))
