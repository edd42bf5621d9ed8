"""to_prometheus_rules: a rules file Prometheus loads, with gpulab's fixed metric names.

The expressions are checked against a PromQL subset grammar (operator precedence, bool
modifiers, on(...) matching, subqueries) written here, not by string matching.
"""

from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lark import Lark, Token, Tree

from gpulab.hub.alerts import Rule, parse_rule, parse_rules, to_prometheus_rules
from tests.harness.alerts import actions, expressions

PROMQL = r"""
?start: expr
?expr: or_e
?or_e: and_e (OR matching? and_e)*
?and_e: cmp_e (SETOP matching? cmp_e)*
?cmp_e: add_e (CMP BOOL? add_e)*
?add_e: mul_e (ADDOP mul_e)*
?mul_e: atom (MULOP atom)*
?atom: NUMBER -> number
     | METRIC -> selector
     | call
     | "(" expr ")" -> paren
     | "(" expr ")" "[" DURATION ":" DURATION "]" -> subquery
call: FUNC "(" expr ("," expr)* ")"
matching: ON "(" LABEL ("," LABEL)* ")"
OR: "or"
SETOP: "and" | "unless"
ON: "on"
BOOL: "bool"
FUNC.2: /(sum|min|max|count)_over_time|clamp_min/
METRIC: /gpulab_[a-z_]+/
LABEL: /[a-z_]+/
CMP: /==|!=|>=|<=|>|</
ADDOP: "+" | "-"
MULOP: "*" | "/"
DURATION: /([0-9]+[dhms])+/
NUMBER: /[0-9]+(\.[0-9]+)?(e[+-]?[0-9]+)?/
%ignore " "
"""
promql = Lark(PROMQL, parser="lalr")
SERVED = {
    "gpulab_gpu_utilization_ratio",
    "gpulab_gpu_memory_used_bytes",
    "gpulab_gpu_memory_limit_bytes",
    "gpulab_gpu_temperature_celsius",
    "gpulab_gpu_power_watts",
}


def parse_expr(expr: str) -> Tree[Token]:
    tree = promql.parse(expr)
    for sel in tree.find_data("selector"):
        assert str(sel.children[0]) in SERVED
    for call in tree.find_data("call"):
        fn, *args = call.children
        if str(fn).endswith("_over_time"):  # range functions take a subquery
            assert len(args) == 1 and isinstance(args[0], Tree) and args[0].data == "subquery"
    for m in tree.find_data("matching"):
        assert [str(x) for x in m.children[1:]] == ["gpu", "user", "server"]
    return tree


def only_rule(text: str, **kw) -> dict:
    file = to_prometheus_rules([parse_rule(text)], **kw)
    [group] = file["groups"]
    [rule] = group["rules"]
    return rule


def test_a_single_for_becomes_the_rules_for_clause():
    rule = only_rule('IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU")')
    assert rule["alert"] == "IDLE_GPU"
    assert rule["expr"] == "gpulab_gpu_utilization_ratio < 0.05"
    assert rule["for"] == "30m"
    assert rule["labels"] == {"severity": "warning"}
    parse_expr(rule["expr"])


def test_a_conjunction_with_one_shared_for_uses_the_for_clause():
    rule = only_rule(
        "IF gpu_utilization > 90% FOR 5m AND gpu_memory_used > 95% FOR 5m "
        'THEN alert("HIGH_LOAD", severity="critical")'
    )
    assert rule["for"] == "5m"
    assert "_over_time" not in rule["expr"]
    tree = parse_expr(rule["expr"])
    assert tree.data == "and_e"
    assert rule["labels"] == {"severity": "critical"}


def test_differing_fors_become_subqueries_with_exactly_d_over_step_points():
    rule = only_rule(
        'IF gpu_utilization > 90% FOR 5m AND gpu_memory_used > 95% THEN alert("HIGH_LOAD")'
    )
    assert "for" not in rule
    tree = parse_expr(rule["expr"])
    [sub] = list(tree.find_data("subquery"))
    assert [str(c) for c in sub.children if isinstance(c, Token)] == ["5m", "15s"]
    assert "gpulab_gpu_utilization_ratio > bool 0.9" in rule["expr"]
    assert re.search(r"\[5m:15s\]\) >= 20\b", rule["expr"])
    # memory percent is of the share's limit, and a zero limit never matches
    assert "gpulab_gpu_memory_used_bytes / (gpulab_gpu_memory_limit_bytes > 0)" in rule["expr"]


def test_the_subquery_step_divides_the_duration():
    rule = only_rule(
        'IF gpu_power > 300W FOR 100s OR gpu_temperature > 85C THEN alert("HOT")', step_seconds=15
    )
    assert "[1m40s:5s]) >= 20" in rule["expr"]
    parse_expr(rule["expr"])


def test_not_is_the_complement_within_the_devices_that_report_memory():
    rule = only_rule('IF NOT gpu_temperature < 80C THEN alert("UNKNOWN_OR_HOT")')
    tree = parse_expr(rule["expr"])
    assert tree.data == "and_e" and str(tree.children[1]) == "unless"
    assert rule["expr"].startswith("gpulab_gpu_memory_limit_bytes unless on(gpu, user, server)")


def test_units_convert_to_the_exported_base_units():
    exprs = {
        r["alert"]: r["expr"]
        for r in to_prometheus_rules(
            parse_rules(
                'IF gpu_memory_used > 2GiB THEN alert("A")\n'
                'IF gpu_memory_used > 2GB THEN alert("B")\n'
                'IF gpu_memory_free < 512MiB THEN alert("C")\n'
                'IF gpu_temperature >= 85C THEN alert("D")\n'
                'IF gpu_power != 0W THEN alert("E")\n'
            )
        )["groups"][0]["rules"]
    }
    assert exprs["A"] == "gpulab_gpu_memory_used_bytes > 2147483648"
    assert exprs["B"] == "gpulab_gpu_memory_used_bytes > 2000000000"
    assert exprs["C"] == (
        "(clamp_min(gpulab_gpu_memory_limit_bytes - gpulab_gpu_memory_used_bytes, 0)) < 536870912"
    )
    assert exprs["D"] == "gpulab_gpu_temperature_celsius >= 85"
    assert exprs["E"] == "gpulab_gpu_power_watts != 0"
    for expr in exprs.values():
        parse_expr(expr)


def test_every_kind_of_rule_exports_a_parseable_expression():
    rules = parse_rules(
        "IF (gpu_utilization > 90% FOR 5m OR gpu_power > 250W FOR 1h30m) AND NOT "
        '(gpu_memory_free < 10% FOR 30s) THEN alert("A")\n'
        'IF NOT NOT gpu_temperature > 1C OR gpu_memory_used == 0MiB THEN alert("B")\n'
        'IF gpu_utilization > 0% FOR 1m AND gpu_utilization < 50% FOR 2m THEN alert("C")\n'
    )
    for rule in to_prometheus_rules(rules)["groups"][0]["rules"]:
        parse_expr(rule["expr"])
        assert rule["expr"].count("(") == rule["expr"].count(")")


def test_the_file_dumps_as_yaml_and_keeps_names_and_annotations():
    rules = parse_rules(
        'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", message="GPU idle: free it")\n'
        'IF gpu_temperature > 85C THEN alert("HOT", severity="critical")\n'
    )
    text = yaml.safe_dump(to_prometheus_rules(rules, group="gpulab-admin"))
    loaded = yaml.safe_load(text)
    [group] = loaded["groups"]
    assert group["name"] == "gpulab-admin"
    idle, hot = group["rules"]
    assert idle["annotations"]["summary"] == "GPU idle: free it"
    assert parse_rule(idle["annotations"]["gpulab_rule"]) == rules[0]
    assert "{{ $labels.user }}" in idle["annotations"]["description"]
    assert (hot["alert"], hot["labels"]["severity"], "for" in hot) == ("HOT", "critical", False)


def test_step_must_be_positive():
    with pytest.raises(ValueError, match="step_seconds"):
        to_prometheus_rules([], step_seconds=0)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.builds(Rule, expressions, actions), min_size=1, max_size=3))
def test_generated_rules_export_parseable_expressions(rules):
    exported = to_prometheus_rules(rules)["groups"][0]["rules"]
    assert [r["alert"] for r in exported] == [r.name for r in rules]
    for rule in exported:
        parse_expr(rule["expr"])
    yaml.safe_load(yaml.safe_dump(to_prometheus_rules(rules)))


try:  # Prometheus' own parser, ported (GreptimeTeam's promql-parser); optional
    import promql_parser
except ImportError:  # pragma: no cover - depends on the environment
    promql_parser = None

needs_promql_parser = pytest.mark.skipif(
    promql_parser is None, reason="pip install promql-parser for a type-checked PromQL parse"
)


@needs_promql_parser
def test_promql_parser_rejects_what_prometheus_rejects():
    # the checker itself: type errors are errors (so the tests below mean something)
    for bad in ("1 and 2", "sum_over_time(gpulab_gpu_power_watts)", "(x > 1) offset 5m"):
        with pytest.raises(ValueError):
            promql_parser.parse(bad)


@needs_promql_parser
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.builds(Rule, expressions, actions), min_size=1, max_size=3))
def test_generated_rules_export_expressions_prometheus_accepts(rules):
    for rule in to_prometheus_rules(rules)["groups"][0]["rules"]:
        promql_parser.parse(rule["expr"])


def test_messages_are_plain_text_even_with_template_braces():
    rule = only_rule('IF gpu_power > 1W THEN alert("P", message="use {{ $labels.gpu }} {{")')
    assert rule["annotations"]["summary"] == ('use {{ "{{" }} $labels.gpu }} {{ "{{" }}')
    assert "{{ $labels.gpu" not in rule["annotations"]["gpulab_rule"]
