"""Evaluation: rules over a stream of samples per device, reporting firing/resolved transitions.

Semantics (Prometheus-like, per device key):
- a condition without FOR holds at a sample when its comparison is true for that sample;
- a condition with FOR d holds at time t when its comparison has been true at every sample since
  some sample at or before t - d, with no gap between consecutive samples longer than the
  engine's max gap (a gap starts the streak again, as a restarted Prometheus would);
- a metric that is unavailable (None, e.g. temperature on a fractional share, or a memory
  percentage without a limit) makes its comparison false, and breaks a FOR streak;
- a rule fires when its whole condition holds, and resolves at the first sample where it does not.
State per (rule, device) is a few floats (when each FOR streak began), not a sample history.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from .model import And, Condition, Expr, Not, Rule, iter_conditions

DEFAULT_MIN_GAP_SECONDS = 30.0
GAP_FACTOR = 3.0
_SPACINGS_KEPT = 8


@dataclass(frozen=True)
class Sample:
    """One reading of one device. None: not available (e.g. on a fractional share)."""

    t: float  # seconds (any epoch, increasing per device)
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_limit_mib: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class AlertEvent:
    rule: str  # the rule's alert name
    severity: str
    message: str
    device: str
    state: Literal["firing", "resolved"]
    since: float  # when it began firing
    t: float  # when this happened (for an active alert: its latest sample)


def metric_value(sample: Sample, metric: str, unit: str) -> float | None:
    """The sample's figure for `metric`, in `unit`'s base (%, MiB, C, W); None if unavailable."""
    if metric == "gpu_utilization":
        return sample.utilization_pct
    if metric == "gpu_temperature":
        return sample.temperature_c
    if metric == "gpu_power":
        return sample.power_w
    used, limit = sample.memory_used_mib, sample.memory_limit_mib
    if used is None:
        return None
    if metric == "gpu_memory_free":
        if limit is None:
            return None
        used = max(0.0, limit - used)
    if unit == "%":
        return None if not limit or limit <= 0 else 100.0 * used / limit
    return used


def compare(value: float, op: str, threshold: float) -> bool:
    if op == ">":
        return value > threshold
    if op == ">=":
        return value >= threshold
    if op == "<":
        return value < threshold
    if op == "<=":
        return value <= threshold
    if op == "==":
        return value == threshold
    return value != threshold


def comparison_holds(cond: Condition, sample: Sample) -> bool:
    value = metric_value(sample, cond.metric, cond.unit)
    return value is not None and compare(value, cond.op, cond.base_value)


@dataclass
class _RuleState:
    streaks: list[float | None]  # per FOR condition (preorder): when its comparison became true
    since: float | None = None  # firing since
    t: float = 0.0  # latest sample while firing


@dataclass
class _DeviceState:
    last_t: float | None = None
    spacings: deque[float] = field(default_factory=lambda: deque(maxlen=_SPACINGS_KEPT))
    rules: dict[int, _RuleState] = field(default_factory=dict)


class RuleEngine:
    """Evaluates rules per device key; observe() returns only transitions."""

    def __init__(self, rules: Iterable[Rule], max_gap_seconds: float | None = None) -> None:
        """max_gap_seconds: the longest pause between two samples that keeps FOR streaks going.

        None (the default) adapts per device: 3 x its median sample spacing, at least 30 s.
        """
        self.rules = list(rules)
        if max_gap_seconds is not None and not max_gap_seconds > 0:
            raise ValueError(f"max_gap_seconds must be positive, not {max_gap_seconds!r}")
        self.max_gap_seconds = max_gap_seconds
        self._for_conditions = [
            [c for c in iter_conditions(r.condition) if c.for_seconds] for r in self.rules
        ]
        self._devices: dict[str, _DeviceState] = {}

    def _gap_limit(self, dev: _DeviceState) -> float:
        if self.max_gap_seconds is not None:
            return self.max_gap_seconds
        typical = statistics.median(dev.spacings) if dev.spacings else 0.0
        return max(DEFAULT_MIN_GAP_SECONDS, GAP_FACTOR * typical)

    def observe(self, device_key: str, sample: Sample) -> list[AlertEvent]:
        """Feed one sample of one device; the alerts that began firing or resolved with it.

        Samples not newer than the device's previous one are ignored.
        """
        dev = self._devices.setdefault(device_key, _DeviceState())
        t = sample.t
        gap = False
        if dev.last_t is not None:
            if t <= dev.last_t:
                return []
            spacing = t - dev.last_t
            gap = spacing > self._gap_limit(dev)
            if not gap:
                dev.spacings.append(spacing)
        dev.last_t = t

        events: list[AlertEvent] = []
        for i, rule in enumerate(self.rules):
            state = dev.rules.get(i)
            if state is None:
                state = dev.rules[i] = _RuleState([None] * len(self._for_conditions[i]))
            counter = iter(range(len(state.streaks)))
            holds = self._eval(rule.condition, sample, state, counter, gap)
            if holds and state.since is None:
                state.since, state.t = t, t
                events.append(self._event(rule, device_key, "firing", t, t))
            elif holds:
                state.t = t
            elif state.since is not None:
                events.append(self._event(rule, device_key, "resolved", state.since, t))
                state.since = None
        return events

    def _eval(
        self, expr: Expr, sample: Sample, state: _RuleState, counter: Iterator[int], gap: bool
    ) -> bool:
        # every node is evaluated (no short-circuit): each FOR streak sees every sample
        if isinstance(expr, Condition):
            ok = comparison_holds(expr, sample)
            if not expr.for_seconds:
                return ok
            k = next(counter)
            start = state.streaks[k]
            if not ok:
                state.streaks[k] = None
                return False
            if start is None or gap:
                start = state.streaks[k] = sample.t
            return sample.t - start >= expr.for_seconds
        if isinstance(expr, Not):
            return not self._eval(expr.operand, sample, state, counter, gap)
        results = [self._eval(o, sample, state, counter, gap) for o in expr.operands]
        return all(results) if isinstance(expr, And) else any(results)

    @staticmethod
    def _event(
        rule: Rule, device: str, state: Literal["firing", "resolved"], since: float, t: float
    ) -> AlertEvent:
        return AlertEvent(rule.name, rule.severity, rule.message, device, state, since, t)

    def active(self) -> list[AlertEvent]:
        """Alerts firing now, one per (rule, device)."""
        return [
            self._event(self.rules[i], key, "firing", st.since, st.t)
            for key, dev in self._devices.items()
            for i, st in dev.rules.items()
            if st.since is not None
        ]

    def forget(self, device_key: str, t: float | None = None) -> list[AlertEvent]:
        """Drop a device (its server stopped): its firing alerts resolve (at t, or their last sample)."""
        dev = self._devices.pop(device_key, None)
        if dev is None:
            return []
        return [
            self._event(self.rules[i], device_key, "resolved", st.since, st.t if t is None else t)
            for i, st in dev.rules.items()
            if st.since is not None
        ]

    def devices(self) -> list[str]:
        return list(self._devices)
