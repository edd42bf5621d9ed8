"""Invariants: any text parses or raises RuleError; every rule survives to_text -> parse."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulab.hub.alerts import (
    Rule,
    RuleError,
    parse_rule,
    parse_rules,
)
from tests.harness.alerts import actions, expressions

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


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.builds(Rule, expressions, actions), min_size=1, max_size=4))
def test_generated_rules_round_trip_through_their_text(rules):
    for rule in rules:
        assert parse_rule(rule.to_text()) == rule
    text = "\n".join(r.to_text() for r in rules)
    assert parse_rules(text) == rules
