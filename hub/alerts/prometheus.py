"""Rules -> a Prometheus alerting rules file (as a dict, yaml.safe_dump-able).

The metrics are the ones gpulab's single-user servers (and the hub's gpulab-metrics service)
export, each with the labels gpu, user and server:
gpulab_gpu_utilization_ratio (0-1), gpulab_gpu_memory_used_bytes, gpulab_gpu_memory_limit_bytes,
gpulab_gpu_temperature_celsius, gpulab_gpu_power_watts.

FOR: when a rule is one condition, or conditions joined by AND that all have the same FOR d
(or none), its expression is the plain comparisons and Prometheus' own `for: d` does the
waiting: "held at every evaluation for d" of a conjunction is the conjunction of the "held for
d" of its parts. Any other rule (OR, NOT, or FORs that differ) expresses each FOR condition
with a subquery over the 0/1 form of its comparison,

    sum_over_time((gpulab_gpu_utilization_ratio > bool 0.9)[5m:15s]) >= 20

true when the comparison was true at every one of the d/step points of the window. A point
exists only where the series did (Prometheus' lookback and staleness), so a series younger than
d, or one that went away inside the window, does not count as holding: like the engine, a FOR
needs samples all along. The step divides d (the gcd of d and step_seconds), so the window holds
exactly d/step points.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .model import MIB, And, Condition, Expr, Not, Rule, format_duration, format_number

UTILIZATION = "gpulab_gpu_utilization_ratio"
MEMORY_USED = "gpulab_gpu_memory_used_bytes"
MEMORY_LIMIT = "gpulab_gpu_memory_limit_bytes"
TEMPERATURE = "gpulab_gpu_temperature_celsius"
POWER = "gpulab_gpu_power_watts"
METRIC_NAMES = (UTILIZATION, MEMORY_USED, MEMORY_LIMIT, TEMPERATURE, POWER)
MATCH = "on(gpu, user, server)"
# every device of every server exports its memory limit: the set NOT takes its complement in
UNIVERSE = MEMORY_LIMIT


def _metric(cond: Condition) -> tuple[str, float]:
    """The PromQL expression of the condition's metric and the threshold in its unit."""
    if cond.metric == "gpu_utilization":
        return UTILIZATION, cond.value / 100
    if cond.metric == "gpu_temperature":
        return TEMPERATURE, cond.value
    if cond.metric == "gpu_power":
        return POWER, cond.value
    amount = MEMORY_USED
    if cond.metric == "gpu_memory_free":
        amount = f"clamp_min({MEMORY_LIMIT} - {MEMORY_USED}, 0)"
    if cond.unit == "%":
        return f"{amount} / ({MEMORY_LIMIT} > 0)", cond.value / 100
    return amount, cond.base_value * MIB


def _number(value: float) -> str:
    # PromQL number literals: plain decimal or scientific, both as Python writes them
    return format_number(round(value, 12) if math.isfinite(value) else value)


def comparison(cond: Condition, as_bool: bool = False) -> str:
    expr, threshold = _metric(cond)
    if " " in expr:
        expr = f"({expr})"
    return f"{expr} {cond.op}{' bool' if as_bool else ''} {_number(threshold)}"


def held_for(cond: Condition, step_seconds: int) -> str:
    step = math.gcd(cond.for_seconds, step_seconds)
    points = cond.for_seconds // step
    window = f"[{format_duration(cond.for_seconds)}:{format_duration(step)}]"
    return f"sum_over_time(({comparison(cond, as_bool=True)}){window}) >= {points}"


def expression(expr: Expr, step_seconds: int, rule_for: bool = False) -> str:
    """PromQL for a condition tree; rule_for: FORs are left to the rule's `for:`."""
    if isinstance(expr, Condition):
        if expr.for_seconds and not rule_for:
            return held_for(expr, step_seconds)
        return comparison(expr)
    if isinstance(expr, Not):
        return f"{UNIVERSE} unless {MATCH} ({expression(expr.operand, step_seconds, rule_for)})"
    op = "and" if isinstance(expr, And) else "or"
    parts = [f"({expression(o, step_seconds, rule_for)})" for o in expr.operands]
    return f" {op} {MATCH} ".join(parts)


def rule_level_for(rule: Rule) -> int | None:
    """The rule's single FOR when Prometheus' `for:` expresses it exactly, else None."""
    expr = rule.condition
    conds = [expr] if isinstance(expr, Condition) else list(getattr(expr, "operands", ()))
    if not isinstance(expr, (Condition, And)) or not all(isinstance(c, Condition) for c in conds):
        return None
    durations = {c.for_seconds for c in conds if isinstance(c, Condition)}
    return durations.pop() if len(durations) == 1 else None


def template_literal(text: str) -> str:
    """Text as a Go template that renders it unchanged (Prometheus templates annotations)."""
    return text.replace("{{", '{{ "{{" }}')


def prometheus_rule(rule: Rule, step_seconds: int = 15) -> dict[str, Any]:
    rule_for = rule_level_for(rule)
    out: dict[str, Any] = {
        "alert": rule.name,
        "expr": expression(rule.condition, step_seconds, rule_for=rule_for is not None),
    }
    if rule_for:
        out["for"] = format_duration(rule_for)
    out["labels"] = {"severity": rule.severity}
    out["annotations"] = {
        "summary": template_literal(rule.message),
        "description": "{{ $labels.user }}/{{ $labels.server }} GPU {{ $labels.gpu }}: "
        + rule.condition.to_text(),
        "gpulab_rule": template_literal(rule.to_text()),
    }
    return out


def to_prometheus_rules(
    rules: Iterable[Rule], group: str = "gpulab", step_seconds: int = 15
) -> dict[str, Any]:
    """A Prometheus rules file: {"groups": [{"name": group, "rules": [...]}]}.

    step_seconds: the subquery resolution for FOR conditions that need one (see the module doc);
    the scrape interval is a good value.
    """
    if step_seconds < 1:
        raise ValueError(f"step_seconds must be at least 1, not {step_seconds!r}")
    return {
        "groups": [{"name": group, "rules": [prometheus_rule(r, int(step_seconds)) for r in rules]}]
    }
