"""Per-user and per-group GPU budgets in exact milli-GPU, and the ledger that enforces them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral
from types import MappingProxyType

from .errors import InvalidQuota, QuotaExceeded
from .model import Placement, Request
from .units import fmt_gpus


@dataclass(frozen=True)
class Quota:
    """GPU budgets in milli-GPU (1000 = one GPU); fractions are counted exactly.

    ``users`` caps one user's allocations; a user missing from it gets ``default_user_milli``
    (None = unlimited). ``groups`` caps the sum over every allocation made on behalf of the group.
    With ``allow_preemptible_over_quota`` a preemptible request beyond the budget is still admitted,
    marked ``over_quota``, not counted against the budget and reclaimed first by preemption.

    Every budget is an int >= 0 (any ``numbers.Integral`` but bool, stored as int) or, for
    ``default_user_milli``, None. Anything else raises ``InvalidQuota`` naming the field: nan
    (it compares false with everything and would switch the quota off), inf (say None), floats
    and Fractions even when whole (milli are counted exactly; convert GPUs at the edge, as
    ``GPUCapacity`` does, where 1.5 GPUs or '3/8' are fine), bools, strings.
    """

    users: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, int] = field(default_factory=dict)
    default_user_milli: int | None = None
    allow_preemptible_over_quota: bool = True

    def __post_init__(self) -> None:
        # exact ints only: a nan compares false with everything (it would switch the quota off),
        # a float or Fraction would make every budget check inexact or raise later in place()
        for kind, table in (("users", self.users), ("groups", self.groups)):
            if not isinstance(table, Mapping):
                raise InvalidQuota(f"Quota.{kind} must map names to milli-GPU, got {table!r}")
            checked = {}
            for key, value in table.items():
                if not isinstance(key, str) or not key:
                    raise InvalidQuota(f"Quota.{kind}: keys must be non-empty names, got {key!r}")
                checked[key] = _check_milli(f"Quota.{kind}[{key!r}]", value)
            object.__setattr__(self, kind, MappingProxyType(checked))
        if self.default_user_milli is not None:
            object.__setattr__(
                self,
                "default_user_milli",
                _check_milli("Quota.default_user_milli", self.default_user_milli),
            )
        if not isinstance(self.allow_preemptible_over_quota, bool):
            raise InvalidQuota(
                "Quota.allow_preemptible_over_quota must be True or False, "
                f"got {self.allow_preemptible_over_quota!r}"
            )

    def user_limit(self, owner: str) -> int | None:
        """The user's budget in milli-GPU, or None when unlimited."""
        return self.users.get(owner, self.default_user_milli)


def _check_milli(field_name: str, value: object) -> int:
    """``value`` as an int of milli-GPU >= 0, or InvalidQuota naming ``field_name``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise InvalidQuota(
            f"{field_name} must be an int of milli-GPU >= 0 (1000 = one GPU; None for no limit), "
            f"got {value!r}"
        )
    return int(value)


class QuotaLedger:
    """Counted usage per user and group (over-quota preemptible work is not counted)."""

    def __init__(self, quota: Quota | None) -> None:
        self.quota = quota or Quota()
        self.user_used: dict[str, int] = {}
        self.group_used: dict[str, int] = {}
        self.user_total: dict[str, int] = {}

    def admit(self, request: Request) -> bool:
        """Check ``request`` against the budgets; return whether it runs over quota.

        Raises QuotaExceeded when it does not fit its budgets and may not run over quota.
        """
        milli = request.total_gpu_milli
        if not milli:
            return False
        problem = self._problem(request, milli)
        if problem is None:
            return False
        if request.preemptible and self.quota.allow_preemptible_over_quota:
            return True
        hint = (
            " Release a server or ask for a preemptible (spot) server."
            if not request.preemptible
            else ""
        )
        raise QuotaExceeded(problem + hint)

    def _problem(self, request: Request, milli: int) -> str | None:
        limit = self.quota.user_limit(request.owner)
        if limit is not None:
            used = self.user_used.get(request.owner, 0)
            if used + milli > limit:
                return (
                    f"User {request.owner!r} asks for {fmt_gpus(milli)} but has "
                    f"{fmt_gpus(limit - used)} "
                    f"of a {fmt_gpus(limit)} budget left."
                )
        for group in sorted(request.groups):
            glimit = self.quota.groups.get(group)
            if glimit is None:
                continue
            used = self.group_used.get(group, 0)
            if used + milli > glimit:
                return (
                    f"Group {group!r} asks for {fmt_gpus(milli)} but has {fmt_gpus(glimit - used)} "
                    f"of a {fmt_gpus(glimit)} budget left."
                )
        return None

    def add(self, placement: Placement, sign: int = 1) -> None:
        """Count (sign=+1) or uncount (sign=-1) a placement."""
        req = placement.request
        milli = req.total_gpu_milli
        self.user_total[req.owner] = self.user_total.get(req.owner, 0) + sign * milli
        if placement.over_quota or not milli:
            return
        self.user_used[req.owner] = self.user_used.get(req.owner, 0) + sign * milli
        for group in req.groups:
            self.group_used[group] = self.group_used.get(group, 0) + sign * milli

    def left(self, owner: str, groups: frozenset[str]) -> int | None:
        """Milli-GPU the user may still take on-demand (the tightest budget), None = unlimited."""
        lefts: list[int] = []
        limit = self.quota.user_limit(owner)
        if limit is not None:
            lefts.append(limit - self.user_used.get(owner, 0))
        for group in groups:
            glimit = self.quota.groups.get(group)
            if glimit is not None:
                lefts.append(glimit - self.group_used.get(group, 0))
        return max(0, min(lefts)) if lefts else None
