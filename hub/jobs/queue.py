"""The order of queued runs and the sentence that tells a waiting user why she waits.

Pure: the caller (the job service) brings what only the running hub knows, such as whether a
place for the run's share is free now and how much of each budget is used, and gets back the
order to try admissions in, each run's position and a reason such as
"waiting for quota of group students". The same inputs always give the same sentence, so the
REST API, the jobs panel and the CLI say the same thing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..allocator import Placement, Quota
from ..allocator.units import fmt_gpus
from .model import Run, RunState


def queue_key(run: Run) -> tuple[int, float, int]:
    """Sort key of the queue: higher priority first, then earlier submission, then the run id
    (ids grow with submission, so runs submitted in the same instant stay first in, first out).

    A retried run keeps its submission time: it was already admitted once, and sending it to
    the back of the queue for a preemption that was not its doing would punish it twice.
    """
    return (-run.priority, run.submitted_at, run.id)


def queue_order(runs: Iterable[Run]) -> list[Run]:
    """The queued runs among ``runs``, in the order admissions are tried."""
    return sorted((r for r in runs if r.state is RunState.QUEUED), key=queue_key)


def queue_positions(runs: Iterable[Run]) -> dict[int, int]:
    """Run id -> position in the queue (1 = next to be tried), for the queued runs only."""
    return {run.id: i for i, run in enumerate(queue_order(runs), start=1)}


def share_label(num_gpu: int = 0, gpu_milli: int = 0) -> str:
    """What a share is called in a waiting reason: ``'1/4 GPU'``, ``'1 GPU'``, ``'2 GPUs'``,
    ``'0.3 GPU'`` (a fraction that is not 1/n), ``'CPU-only place'``."""
    if num_gpu:
        return f"{num_gpu} GPU" if num_gpu == 1 else f"{num_gpu} GPUs"
    if not gpu_milli:
        return "CPU-only place"
    if 1000 % gpu_milli == 0:
        return f"1/{1000 // gpu_milli} GPU"
    return fmt_gpus(gpu_milli)


def quota_holder_short(
    quota: Quota,
    owner: str,
    groups: Iterable[str],
    gpu_milli: int,
    user_used_milli: int,
    group_used_milli: Mapping[str, int],
) -> str | None:
    """The budget that cannot take ``gpu_milli`` more now: ``'user alice'``, ``'group students'``
    (groups in name order, the user's own budget first), or None when every budget has room.

    The allocator's ``QuotaLedger`` makes the same comparison when it refuses a placement; this
    one names the holder for a sentence instead of raising.
    """
    if not gpu_milli:
        return None
    limit = quota.user_limit(owner)
    if limit is not None and user_used_milli + gpu_milli > limit:
        return f"user {owner}"
    for group in sorted(groups):
        glimit = quota.groups.get(group)
        if glimit is not None and group_used_milli.get(group, 0) + gpu_milli > glimit:
            return f"group {group}"
    return None


def quota_usage(placements: Iterable[Placement]) -> tuple[dict[str, int], dict[str, int]]:
    """Milli-GPU counted against each user's and each group's budget by ``placements`` (the
    allocator's ``allocations()``), as its quota ledger counts them: over-quota preemptible
    placements are not counted."""
    users: dict[str, int] = {}
    groups: dict[str, int] = {}
    for placement in placements:
        request = placement.request
        if placement.over_quota or not request.total_gpu_milli:
            continue
        users[request.owner] = users.get(request.owner, 0) + request.total_gpu_milli
        for group in request.groups:
            groups[group] = groups.get(group, 0) + request.total_gpu_milli
    return users, groups


@dataclass(frozen=True)
class WaitFacts:
    """What the hub knows about a queued run's chances right now.

    ``runs_ahead``: queued runs before it (its position - 1). ``share``: what it asks for, as
    ``share_label`` writes it. ``fits_now``: a place for that share is free now (the allocator's
    ``capacity`` of its request is > 0). ``quota_short``: the budget that stops it
    (``quota_holder_short``), None when its budgets have room.
    """

    runs_ahead: int
    share: str
    fits_now: bool
    quota_short: str | None = None


def waiting_reason(facts: WaitFacts) -> str:
    """Why a queued run waits, the first obstacle first: its quota (no free GPU would help), then
    a free place, then the runs ahead of it.

    "waiting for quota of group students", "waiting for a free 1/4 GPU (3 runs ahead)",
    "waiting behind 3 runs", "next to be admitted".
    """
    ahead = facts.runs_ahead
    behind = f"{ahead} run" if ahead == 1 else f"{ahead} runs"
    if facts.quota_short is not None:
        return f"waiting for quota of {facts.quota_short}"
    if not facts.fits_now:
        suffix = f" ({behind} ahead)" if ahead else ""
        return f"waiting for a free {facts.share}{suffix}"
    if ahead:
        return f"waiting behind {behind}"
    return "next to be admitted"
