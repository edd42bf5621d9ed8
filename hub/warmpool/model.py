"""Warm pool configuration and planning (pure: no JupyterHub, no processes, no clock of its own).

A pool keeps `min` pre-started servers of one profile ready while its schedule is on, and grows
towards `max` while people claim them (each claim in the demand window asks for one more), so
that a burst of logins after a lecture starts is served warm as far as `max` allows. Outside its
schedule a pool wants none: its GPUs go back to everyone else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

#: the allocator owner of every pool member's reservation: gpulab's overhead account in the
#: GPU-hour ledger. The hub refuses it as a user name (`GPULabHubHooks.validate_username`), so
#: no person's quota, usage or servers are ever mixed with it.
WARM_POOL_OWNER = "gpulab:warm-pool"

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW = re.compile(
    r"^(?P<days>[a-z]{3}(?:-[a-z]{3})?(?:,[a-z]{3}(?:-[a-z]{3})?)*)\s+"
    r"(?P<start>\d{1,2}:\d{2})-(?P<end>\d{1,2}:\d{2})$"
)


class PoolConfigError(ValueError):
    """A warm pool setting that cannot be used; the message names the setting."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where


def member_allocation_id(profile: str, serial: int) -> str:
    """The allocator id of a pool member's reservation."""
    return f"{WARM_POOL_OWNER}/{profile}-{serial}"


def is_pool_allocation(allocation_id: str) -> bool:
    return allocation_id.startswith(WARM_POOL_OWNER + "/")


@dataclass(frozen=True)
class Window:
    """Days of the week (0 = Monday) and a time of day [start, end) in minutes; an end at or
    before the start runs past midnight into the next day."""

    days: frozenset[int]
    start_minute: int
    end_minute: int

    def covers(self, when: datetime) -> bool:
        minute = when.hour * 60 + when.minute
        day = when.weekday()
        if self.start_minute < self.end_minute:
            return day in self.days and self.start_minute <= minute < self.end_minute
        # past midnight: the evening part on a listed day, the morning part on the day after
        if day in self.days and minute >= self.start_minute:
            return True
        return (day - 1) % 7 in self.days and minute < self.end_minute


def _minute(text: str, where: str) -> int:
    hours, minutes = (int(x) for x in text.split(":"))
    if not (0 <= hours <= 24 and 0 <= minutes < 60) or (hours == 24 and minutes):
        raise PoolConfigError(where, f"{text!r} is not a time of day (00:00-24:00)")
    return hours * 60 + minutes


def _days(text: str, where: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        for name in (first, last or first):
            if name not in DAYS:
                raise PoolConfigError(where, f"{name!r} is not a day ({', '.join(DAYS)})")
        a, b = DAYS.index(first), DAYS.index(last or first)
        out.update(range(a, b + 1) if a <= b else [*range(a, 7), *range(0, b + 1)])
    return frozenset(out)


def parse_schedule(value: Any, where: str = "schedule") -> tuple[Window, ...]:
    """'always' (or nothing) -> () meaning always on; else windows like "mon-fri 08:00-19:00",
    several separated by ';' or given as a list."""
    if value in (None, "", "always"):
        return ()
    items: Sequence[Any] = value.split(";") if isinstance(value, str) else value
    if not isinstance(items, Sequence) or isinstance(items, bytes):
        raise PoolConfigError(
            where, f"expected 'always' or windows like 'mon-fri 08:00-19:00', got {value!r:.80}"
        )
    windows = []
    for item in items:
        text = str(item).strip().lower() if isinstance(item, str) else None
        match = _WINDOW.match(text or "")
        if text is None or match is None:
            raise PoolConfigError(where, f"{item!r:.80} is not a window like 'mon-fri 08:00-19:00'")
        start = _minute(match["start"], where)
        end = _minute(match["end"], where)
        if start == end:
            raise PoolConfigError(where, f"{item!r} starts and ends at the same time")
        windows.append(Window(_days(match["days"], where), start, end % (24 * 60)))
    return tuple(windows)


@dataclass(frozen=True)
class PoolSpec:
    """One pool: `min` ready members of `profile` while `schedule` is on (() = always), growing
    by one per claim in the demand window up to `max` members (ready and starting)."""

    profile: str
    min: int
    max: int
    schedule: tuple[Window, ...] = ()

    def on(self, when: datetime) -> bool:
        return not self.schedule or any(w.covers(when) for w in self.schedule)

    def desired(self, when: datetime, recent_claims: int) -> int:
        """How many members the pool wants now (0 while its schedule is off)."""
        if not self.on(when):
            return 0
        return min(self.max, self.min + max(0, recent_claims))


def parse_pools(entries: Any, known_profiles: Iterable[str]) -> list[PoolSpec]:
    """`GPUWarmPool.pools` -> specs; PoolConfigError naming the entry and key otherwise."""
    known = set(known_profiles)
    if not isinstance(entries, Sequence) or isinstance(entries, str | bytes):
        raise PoolConfigError("GPUWarmPool.pools", f"expected a list of pools, got {entries!r:.80}")
    specs: list[PoolSpec] = []
    for i, entry in enumerate(entries):
        where = f"GPUWarmPool.pools[{i}]"
        if not isinstance(entry, Mapping):
            raise PoolConfigError(
                where, f"expected {{profile, min, max, schedule}}, got {entry!r:.80}"
            )
        unknown = set(entry) - {"profile", "min", "max", "schedule"}
        if unknown:
            raise PoolConfigError(
                where,
                f"unknown key(s) {sorted(unknown)}; a pool takes profile, min, max and schedule",
            )
        profile = entry.get("profile")
        if profile not in known:
            raise PoolConfigError(
                f"{where}.profile",
                f"{profile!r} is not a profile of the catalog ({', '.join(sorted(known))})",
            )
        if any(s.profile == profile for s in specs):
            raise PoolConfigError(f"{where}.profile", f"{profile!r} has a pool already")
        low = entry.get("min", 1)
        high = entry.get("max", low)
        for key, value in (("min", low), ("max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1000:
                raise PoolConfigError(
                    f"{where}.{key}", f"expected a whole number 0-1000, got {value!r}"
                )
        if high < low:
            raise PoolConfigError(f"{where}.max", f"{high} is below min ({low})")
        schedule = parse_schedule(entry.get("schedule"), f"{where}.schedule")
        specs.append(PoolSpec(str(profile), low, high, schedule))
    return specs


@dataclass(frozen=True)
class Member:
    """What planning needs to know of a member: its id, what it was started from and whether
    it is ready (else still starting)."""

    id: str
    profile: str
    fingerprint: str
    ready: bool
    started_at: float = 0.0


@dataclass(frozen=True)
class Plan:
    start: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    #: why each stopped member goes: "stale" (its profile or command changed) or "surplus"
    reasons: Mapping[str, str] = field(default_factory=dict)


def plan(desired: int, members: Iterable[Member], fingerprint: str) -> Plan:
    """What to do for one pool: stop members started from another definition (stale), stop the
    newest surplus ones (starting first: they cost least to give up), start what is missing."""
    stale = [m for m in members if m.fingerprint != fingerprint]
    fresh = [m for m in members if m.fingerprint == fingerprint]
    surplus = max(0, len(fresh) - desired)
    by_cost = sorted(fresh, key=lambda m: (m.ready, -m.started_at))
    reasons = {m.id: "stale" for m in stale}
    reasons.update({m.id: "surplus" for m in by_cost[:surplus]})
    return Plan(
        start=max(0, desired - len(fresh)),
        stop=tuple(reasons),
        reasons=reasons,
    )
