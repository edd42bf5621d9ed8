"""Idleness per GPU slice: since when a slice has stayed below the threshold, and whether that
is known at all.

A slice is what one server holds of a GPU, so a fractional share is judged by its own processes'
figure, never by the whole device's (a busy neighbour must not keep an abandoned share alive).
A device-wide figure below the threshold still proves the slice idle (its own work is part of
it); at or above, it proves nothing about the slice, so it counts as not idle.

A run of samples below the threshold starts again after a gap longer than the policy's
``stale_sample_seconds`` (nobody knows what ran meanwhile), and a slice whose latest sample is
older than that is unknown: unknown never counts as idle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from .model import SliceFigures, SliceSample, SliceSummary

SliceIdleness = Literal["idle", "idle-briefly", "busy", "unknown"]


def advance(summary: SliceSummary, sample: SliceSample, max_gap_seconds: float) -> SliceSummary:
    """``summary`` with one more sample folded in; a sample not newer than the latest is ignored
    (pushes may arrive twice or out of order)."""
    last = summary.last_sample_at
    if last is not None and sample.t <= last:
        return summary
    pct = sample.utilization_pct
    below = pct is not None and pct < summary.threshold_pct
    gap = last is not None and sample.t - last > max_gap_seconds
    if not below:
        below_since = None
    elif summary.below_since is None or gap:
        below_since = sample.t
    else:
        below_since = summary.below_since
    return replace(
        summary,
        last_sample_at=sample.t,
        below_since=below_since,
        latest_pct=pct,
        latest_scope=sample.scope,
    )


def summarize(
    samples: Iterable[SliceSample], threshold_pct: float, max_gap_seconds: float
) -> SliceSummary:
    """The summary of a window of samples (in any order) against ``threshold_pct``."""
    summary = SliceSummary(threshold_pct)
    for sample in sorted(samples, key=lambda s: s.t):
        summary = advance(summary, sample, max_gap_seconds)
    return summary


@dataclass(frozen=True)
class SliceStatus:
    """One slice judged at one check: ``detail`` is the phrase a reason quotes."""

    name: str
    idleness: SliceIdleness
    idle_seconds: float  # how long it has been seen below the threshold (0 unless idle-ish)
    detail: str


def judge_slice(
    name: str,
    figures: SliceFigures,
    *,
    threshold_pct: float,
    idle_seconds_needed: int,
    stale_seconds: int,
    fractional: bool,
    now: float,
) -> SliceStatus:
    """Whether the slice ``name`` has been below ``threshold_pct`` for ``idle_seconds_needed``.

    Idleness is what the samples show (latest sample minus the start of the run below), never
    extrapolated to ``now``. ValueError when a summary was folded against another threshold:
    the caller must summarise again after the rule changed."""
    if isinstance(figures, SliceSummary):
        if figures.threshold_pct != threshold_pct:
            raise ValueError(
                f"slice {name}: summarised against {figures.threshold_pct:g}% but the rule's"
                f" threshold is {threshold_pct:g}%; summarise its samples again"
            )
        summary = figures
    else:
        summary = summarize(figures, threshold_pct, stale_seconds)
    last = summary.last_sample_at
    if last is None:
        return SliceStatus(name, "unknown", 0.0, f"{name}: no GPU samples yet (unknown)")
    age = now - last
    if age > stale_seconds:
        return SliceStatus(
            name, "unknown", 0.0, f"{name}: no GPU sample for {duration(age)} (unknown)"
        )
    pct = summary.latest_pct
    if pct is None:
        return SliceStatus(name, "unknown", 0.0, f"{name}: utilisation not measurable (unknown)")
    if summary.below_since is None:
        detail = f"{name} at {percent(pct)}"
        if fractional and summary.latest_scope == "device":
            detail += " (whole-device figure, neighbours included: the share's own is not measured)"
        return SliceStatus(name, "busy", 0.0, detail)
    seen = last - summary.below_since
    below = f"{name} below {percent(threshold_pct)} for {duration(seen)}"
    if seen < idle_seconds_needed:
        return SliceStatus(
            name, "idle-briefly", seen, f"{below}, not yet {duration(idle_seconds_needed)}"
        )
    return SliceStatus(name, "idle", seen, below)


def duration(seconds: float) -> str:
    """'45 s', '47 min', '2 h', '2 h 5 min' (rounded down: a reason never overstates idleness)."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole} s"
    hours, minutes = divmod(whole // 60, 60)
    if not hours:
        return f"{minutes} min"
    return f"{hours} h" + (f" {minutes} min" if minutes else "")


def percent(value: float) -> str:
    return f"{round(value, 1):g}%"
