"""GPU-hours from intervals: allocated (fraction x time), used (the monitor's samples), idle.

Allocated GPU-hours are exact: milli-GPU x whole seconds are integers until the final division,
so four quarter shares held for an hour are 1.00 GPU-hour, not 0.9999. Used GPU-hours come from
the GPU monitor's samples (utilisation x seconds between pushes, what the metrics service
records per user, server, device and hour); they are capped per interval and hour at what was
allocated, because a fractional share's device-wide figure includes its neighbours' work.
Only intervals of monitored workloads (`MONITORED_WORKLOADS`: servers, job runs, Dask workers)
have used and idle GPU-hours: the allocated hours of the others (external pods) are counted as
unmonitored, since no figure says whether they used them. Idle = allocated - unmonitored - used.

Buckets are UTC calendar hours, days and months. A rollup by group counts an interval towards
each of its owner's groups at grant time, so group rows may add up to more than the total.
"""

from __future__ import annotations

import calendar
import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .model import MILLI, MONITORED_WORKLOADS, Interval

SECONDS_PER_HOUR = 3600
BUCKETS = ("hour", "day", "month")
#: what a rollup may be grouped by
DIMENSIONS = ("user", "group", "profile", "workload", "gpu_model", "node", "tier")


class RollupError(ValueError):
    """A rollup asked for something that does not exist (the message names the field)."""


@dataclass(frozen=True)
class UsageSample:
    """GPU-seconds the monitor saw used by one server's processes on one device in one hour."""

    user: str
    server: str
    device: str
    hour: int  # the hour's first second (UTC)
    used_gpu_seconds: float
    sampled_seconds: float


@dataclass
class Row:
    """One bucket x group of a rollup, in GPU-hours."""

    bucket: int
    key: tuple[str, ...]
    allocated_milli_seconds: int = 0
    #: the part of allocated_milli_seconds held by unmonitored workloads
    unmonitored_milli_seconds: int = 0
    used_gpu_seconds: float = 0.0
    intervals: set[int] = field(default_factory=set)

    @property
    def allocated_gpu_hours(self) -> float:
        return self.allocated_milli_seconds / (MILLI * SECONDS_PER_HOUR)

    @property
    def unmonitored_gpu_hours(self) -> float:
        return self.unmonitored_milli_seconds / (MILLI * SECONDS_PER_HOUR)

    @property
    def used_gpu_hours(self) -> float:
        return self.used_gpu_seconds / SECONDS_PER_HOUR

    @property
    def idle_gpu_hours(self) -> float:
        return idle_gpu_hours(
            self.allocated_milli_seconds, self.unmonitored_milli_seconds, self.used_gpu_seconds
        )


def idle_gpu_hours(
    allocated_milli_seconds: int, unmonitored_milli_seconds: int, used: float
) -> float:
    """Monitored allocated GPU-hours that were not used (`used` in GPU-seconds)."""
    monitored = (allocated_milli_seconds - unmonitored_milli_seconds) / (MILLI * SECONDS_PER_HOUR)
    return max(0.0, monitored - used / SECONDS_PER_HOUR)


def bucket_start(t: int, bucket: str) -> int:
    """The first second of the UTC hour, day or month holding `t`."""
    if bucket == "hour":
        return t - t % SECONDS_PER_HOUR
    if bucket == "day":
        return t - t % 86400
    if bucket == "month":
        d = dt.datetime.fromtimestamp(t, dt.UTC)
        return calendar.timegm((d.year, d.month, 1, 0, 0, 0))
    raise RollupError(f"bucket: expected one of {', '.join(BUCKETS)}, got {bucket!r}")


def next_bucket(start: int, bucket: str) -> int:
    if bucket == "month":
        d = dt.datetime.fromtimestamp(start, dt.UTC)
        year, month = (d.year + 1, 1) if d.month == 12 else (d.year, d.month + 1)
        return calendar.timegm((year, month, 1, 0, 0, 0))
    return start + (SECONDS_PER_HOUR if bucket == "hour" else 86400)


def buckets(since: int, until: int, bucket: str) -> Iterator[tuple[int, int, int]]:
    """(bucket start, clipped start, clipped end) of every bucket overlapping [since, until)."""
    start = bucket_start(since, bucket)
    while start < until:
        end = next_bucket(start, bucket)
        yield start, max(start, since), min(end, until)
        start = end


def check_dimensions(by: Iterable[str]) -> tuple[str, ...]:
    dims = tuple(by)
    for d in dims:
        if d not in DIMENSIONS:
            raise RollupError(f"by: expected some of {', '.join(DIMENSIONS)}, got {d!r}")
    if len(set(dims)) != len(dims):
        raise RollupError(f"by: {', '.join(dims)} names a dimension twice")
    return dims


def _keys(interval: Interval, dims: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The group keys of one interval (several when grouped by group and it has several)."""
    h = interval.holding
    keys: list[tuple[str, ...]] = [()]
    for d in dims:
        values = (list(h.groups) or [""]) if d == "group" else [str(getattr(h, d))]
        keys = [k + (v,) for k in keys for v in values]
    return keys


def rollup(
    intervals: Iterable[Interval],
    usage: Iterable[UsageSample],
    *,
    since: int,
    until: int,
    bucket: str = "day",
    by: Iterable[str] = ("user",),
) -> list[Row]:
    """Allocated, unmonitored, used and idle GPU-hours per bucket and group within
    [since, until)."""
    if until <= since:
        raise RollupError(f"until ({until}) must be after since ({since})")
    dims = check_dimensions(by)
    bucket_start(since, bucket)  # checks the bucket's name
    rows: dict[tuple[int, tuple[str, ...]], Row] = {}
    chosen = list(intervals)
    for interval in chosen:
        end = until if interval.end is None else min(interval.end, until)
        lo = max(interval.start, since)
        if end <= lo:
            continue
        for start, b_lo, b_hi in buckets(lo, end, bucket):
            amount = interval.holding.milli * (b_hi - b_lo)
            unmonitored = amount if interval.holding.workload not in MONITORED_WORKLOADS else 0
            for key in _keys(interval, dims):
                row = rows.setdefault((start, key), Row(start, key))
                row.allocated_milli_seconds += amount
                row.unmonitored_milli_seconds += unmonitored
                row.intervals.add(interval.id)
    for sample, interval, seconds in attribute_usage(chosen, usage, since, until):
        start = bucket_start(sample.hour, bucket)
        for key in _keys(interval, dims):
            row = rows.setdefault((start, key), Row(start, key))
            row.used_gpu_seconds += seconds
    return [rows[k] for k in sorted(rows)]


def attribute_usage(
    intervals: list[Interval], usage: Iterable[UsageSample], since: int, until: int
) -> Iterator[tuple[UsageSample, Interval, float]]:
    """Each usage sample within [since, until), matched to the interval it was used under (same
    user and device, overlapping its hour, a monitored workload's: the sample's own allocation
    "{user}/{server}" first, then, among servers only, the longest overlap), and capped at what
    that interval allocated in that hour. A job run's or Dask worker's interval takes only its
    own samples (its report names it), never a server's on the same device. A sample of a device
    its own allocation holds under another name (Kubernetes' slots) goes to that allocation. A
    sample no interval matches (someone else's device, a workload gone) is dropped: used never
    exceeds allocated, nor lands on an unmonitored external pod's hours."""
    by_device: dict[tuple[str, str], list[Interval]] = defaultdict(list)
    by_allocation: dict[str, list[Interval]] = defaultdict(list)
    for interval in intervals:
        if interval.holding.workload not in MONITORED_WORKLOADS:
            continue
        by_device[(interval.holding.user, interval.holding.device)].append(interval)
        by_allocation[interval.holding.allocation_id].append(interval)
    spent: dict[tuple[int, int], float] = defaultdict(float)  # (interval id, hour) -> seconds
    for sample in usage:
        if not since <= sample.hour < until:
            continue
        # an open interval counts up to the rollup's end, not the hour's: it was not allocated
        # past now, so a sample must not be credited room it does not have yet
        hour_end = min(sample.hour + SECONDS_PER_HOUR, until)
        best: tuple[int, float, Interval] | None = None
        own_allocation = f"{sample.user}/{sample.server}"
        for interval in by_device.get((sample.user, sample.device), ()):
            overlap = interval.milli_seconds(sample.hour, hour_end)
            if overlap <= 0:
                continue
            own = int(interval.holding.allocation_id == own_allocation)
            if not own and interval.holding.workload != "server":
                continue
            if best is None or (own, overlap) > best[:2]:
                best = (own, overlap, interval)
        if best is None:
            # a device the sample's own allocation holds under another name: on Kubernetes the
            # allocator holds logical slots and the pod's monitor names the physical device the
            # device plugin gave it, so the workload's own intervals take it, the one with the
            # most room left first (a two-GPU pod's two devices fill its two slots)
            for interval in by_allocation.get(own_allocation, ()):
                overlap = interval.milli_seconds(sample.hour, hour_end)
                room = overlap / MILLI - spent[(interval.id, sample.hour)]
                if overlap > 0 and (best is None or room > best[1]):
                    best = (1, room, interval)
            if best is not None:
                best = (1, best[2].milli_seconds(sample.hour, hour_end), best[2])
        if best is None:
            continue
        interval = best[2]
        room = best[1] / MILLI - spent[(interval.id, sample.hour)]
        seconds = max(0.0, min(sample.used_gpu_seconds, room))
        spent[(interval.id, sample.hour)] += seconds
        if seconds > 0:
            yield sample, interval, seconds
