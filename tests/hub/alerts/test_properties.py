"""Invariants: any text parses or raises RuleError; every rule survives to_text -> parse."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulab.hub.alerts import (
    Action,
    And,
    Condition,
    Not,
    Or,
    Rule,
    RuleError,
    parse_rule,
    parse_rules,
)
from gpulab.hub.alerts.model import METRICS, SEVERITIES

FRAGMENTS = [
    "IF", "if", "THEN", "AND", "or", "NOT", "FOR", "(", ")", "alert", '("A")', "gpu_utilization",
    "gpu_memory_used", "gpu_temperature", ">", ">=", "==", "!=", "=", "90", "1e9", "%", "GiB",
    "C", "W", "5m", "1h30m", "x", '"', "'", "\\", ",", "severity=", '"critical"', "message=",
    "#", "\n", "\r\n", " ", "\t", "\x00", "\u00b0C", "\ud800", "é",
]  # fmt: skip


def _check(text: str) -> None:
    try:
        rules = parse_rules(text)
    except RuleError as e:
        assert e.line >= 1 and e.column >= 1
        assert e.message and str(e).startswith(f"line {e.line}, column {e.column}: ")
        return
    for rule in rules:
        assert parse_rule(rule.to_text()) == rule


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_arbitrary_text_parses_or_raises_rule_error(text):
    _check(text)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map(" ".join))
def test_near_miss_rule_text_parses_or_raises_rule_error(text):
    _check(text)


@st.composite
def conditions(draw: st.DrawFn) -> Condition:
    metric = draw(st.sampled_from(list(METRICS)))
    unit = draw(st.sampled_from(METRICS[metric]))
    if unit == "%":
        value = draw(st.floats(0, 100, allow_nan=False))
    else:
        value = draw(st.floats(0, 1e12, allow_nan=False, allow_infinity=False))
    op = draw(st.sampled_from([">", ">=", "<", "<=", "==", "!="]))
    for_seconds = draw(st.one_of(st.just(0), st.integers(1, 30 * 86400)))
    return Condition(metric, op, value, unit, for_seconds)


expressions = st.recursive(
    conditions(),
    lambda children: st.one_of(
        children.map(Not),
        st.lists(children, min_size=2, max_size=4).map(lambda xs: And(tuple(xs))),
        st.lists(children, min_size=2, max_size=4).map(lambda xs: Or(tuple(xs))),
    ),
    max_leaves=12,
)
actions = st.builds(
    Action,
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
    severity=st.sampled_from(SEVERITIES),
    message=st.one_of(st.none(), st.text(max_size=40)),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.builds(Rule, expressions, actions), min_size=1, max_size=4))
def test_generated_rules_round_trip_through_their_text(rules):
    for rule in rules:
        assert parse_rule(rule.to_text()) == rule
    text = "\n".join(r.to_text() for r in rules)
    assert parse_rules(text) == rules
