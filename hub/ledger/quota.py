"""GPU-hour quotas: a budget of allocated GPU-hours per user and per group over a rolling window.

The allocator's quotas bound how much GPU one holds at once; these bound how much one holds over
time (SLURM's GrpTRESMins, a cloud's monthly budget). They count *allocated* GPU-hours
(fraction x time, what the ledger records), not used ones: a share held idle is still a share
nobody else could have. A user is bound by her own budget and by each of her groups'; the
tightest decides. At `warn_ratio` (80 %) of a budget she is warned; at 100 % new work is refused
and, where the admin configured it, running work is checkpointed and stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from .model import MILLI, Interval
from .rollup import SECONDS_PER_HOUR

OK, WARN, EXHAUSTED = "ok", "warn", "exhausted"


class HourQuotaError(ValueError):
    """A GPU-hour quota that cannot be read (the message names the field)."""


def _hours(value: object, field_name: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise HourQuotaError(f"{field_name}: expected a number of GPU-hours, got {value!r}")
    try:
        amount = Fraction(repr(value) if isinstance(value, float) else value)
    except (ValueError, ZeroDivisionError):
        raise HourQuotaError(
            f"{field_name}: {value!r} is not a number of GPU-hours (e.g. 100 or 12.5)"
        ) from None
    if amount < 0:
        raise HourQuotaError(f"{field_name}: {value!r} is negative")
    return amount


@dataclass(frozen=True)
class HourQuota:
    """Budgets in GPU-hours per user and per group, over the last `window_seconds`."""

    users: Mapping[str, Fraction] = field(default_factory=dict)
    groups: Mapping[str, Fraction] = field(default_factory=dict)
    window_seconds: int = 30 * 86400
    warn_ratio: float = 0.8

    @classmethod
    def parse(
        cls,
        users: Mapping[str, object],
        groups: Mapping[str, object],
        window_days: float,
        warn_percent: float = 80,
    ) -> HourQuota:
        if isinstance(window_days, bool) or not isinstance(window_days, int | float):
            raise HourQuotaError(f"window_days: expected a number of days, got {window_days!r}")
        if not 0 < window_days <= 3660 or not math.isfinite(window_days):
            raise HourQuotaError(f"window_days: expected 0 < days <= 3660, got {window_days!r}")
        if not 0 < warn_percent <= 100:
            raise HourQuotaError(f"warn_percent: expected 0 < percent <= 100, got {warn_percent}")
        return cls(
            users={k: _hours(v, f"users[{k!r}]") for k, v in users.items()},
            groups={k: _hours(v, f"groups[{k!r}]") for k, v in groups.items()},
            window_seconds=int(window_days * 86400),
            warn_ratio=warn_percent / 100,
        )

    def __bool__(self) -> bool:
        return bool(self.users or self.groups)

    def applies_to(self, user: str, groups: Iterable[str]) -> bool:
        return user in self.users or any(g in self.groups for g in groups)


@dataclass(frozen=True)
class Budget:
    """One budget's standing: who it binds ("user" or "group" and its name), the limit and the
    allocated GPU-hours counted against it in the window."""

    scope: str
    name: str
    limit_gpu_hours: float
    allocated_gpu_hours: float
    warn_ratio: float

    @property
    def remaining_gpu_hours(self) -> float:
        return max(0.0, self.limit_gpu_hours - self.allocated_gpu_hours)

    @property
    def state(self) -> str:
        if self.allocated_gpu_hours >= self.limit_gpu_hours:
            return EXHAUSTED
        if self.allocated_gpu_hours >= self.warn_ratio * self.limit_gpu_hours:
            return WARN
        return OK

    def describe(self) -> str:
        """'alice: 82.0 of 100 GPU-hours used in the last 30 days, 18.0 left'."""
        who = self.name if self.scope == "user" else f"group {self.name}"
        return (
            f"{who}: {self.allocated_gpu_hours:.1f} of {self.limit_gpu_hours:g} GPU-hours "
            f"allocated, {self.remaining_gpu_hours:.1f} left"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "scope": self.scope,
            "name": self.name,
            "limit_gpu_hours": self.limit_gpu_hours,
            "allocated_gpu_hours": round(self.allocated_gpu_hours, 6),
            "remaining_gpu_hours": round(self.remaining_gpu_hours, 6),
            "state": self.state,
        }


def allocated_milli_seconds(
    intervals: Iterable[Interval], since: int, until: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Milli-GPU-seconds allocated within [since, until) per user and per group."""
    users: dict[str, int] = {}
    groups: dict[str, int] = {}
    for interval in intervals:
        amount = interval.milli_seconds(since, until)
        if not amount:
            continue
        h = interval.holding
        users[h.user] = users.get(h.user, 0) + amount
        for g in h.groups:
            groups[g] = groups.get(g, 0) + amount
    return users, groups


def every_budget(
    quota: HourQuota, by_user: Mapping[str, int], by_group: Mapping[str, int]
) -> list[Budget]:
    """Every configured budget's standing (users' first, then groups', each by name), from the
    window's milli-GPU-seconds per user and group (`allocated_milli_seconds`)."""
    unit = MILLI * SECONDS_PER_HOUR
    configured = [("user", n, limit, by_user) for n, limit in sorted(quota.users.items())]
    configured += [("group", n, limit, by_group) for n, limit in sorted(quota.groups.items())]
    return [
        Budget(scope, name, float(limit), spent.get(name, 0) / unit, quota.warn_ratio)
        for scope, name, limit, spent in configured
    ]


def budgets(
    quota: HourQuota,
    user: str,
    groups: Iterable[str],
    by_user: Mapping[str, int],
    by_group: Mapping[str, int],
) -> list[Budget]:
    """Every budget that binds `user` (hers, then her groups' in name order), from the window's
    milli-GPU-seconds per user and group (`allocated_milli_seconds`)."""
    binding = set(groups)
    return [
        b
        for b in every_budget(quota, by_user, by_group)
        if (b.scope == "user" and b.name == user) or (b.scope == "group" and b.name in binding)
    ]


def tightest(found: Iterable[Budget]) -> Budget | None:
    """The budget with the least left (the one that decides)."""
    return min(found, key=lambda b: (b.remaining_gpu_hours, b.scope != "user"), default=None)


def hours_until_exhausted(budget: Budget, held_milli: int) -> float | None:
    """At the current holding, hours until the budget runs out; None when nothing is held."""
    if held_milli <= 0:
        return None
    return budget.remaining_gpu_hours / (held_milli / MILLI)


def burn_down(
    intervals: Iterable[Interval], limit_gpu_hours: float, since: int, until: int, step: int
) -> list[tuple[int, float]]:
    """(time, GPU-hours left) every `step` seconds over [since, until]: the budget's burn-down."""
    chosen = list(intervals)
    points = []
    t = since
    while True:
        used = sum(i.milli_seconds(since, t) for i in chosen) / (MILLI * SECONDS_PER_HOUR)
        points.append((t, max(0.0, limit_gpu_hours - used)))
        if t >= until:
            return points
        t = min(until, t + step)
