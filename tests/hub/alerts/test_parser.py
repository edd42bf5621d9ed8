"""The rule language: what parses to what, and where each kind of mistake is reported."""

from __future__ import annotations

import pytest

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


def test_the_issue_example_parses_to_a_conjunction_with_its_own_for():
    rule = parse_rule(
        'IF gpu_utilization > 90% FOR 5m AND gpu_memory_used > 95% THEN alert("HIGH_LOAD")'
    )
    assert rule == Rule(
        And(
            (
                Condition("gpu_utilization", ">", 90.0, "%", 300),
                Condition("gpu_memory_used", ">", 95.0, "%", 0),
            )
        ),
        Action("HIGH_LOAD", "warning", None),
    )
    assert rule.name == "HIGH_LOAD"
    assert rule.severity == "warning"


def test_keywords_and_units_are_case_insensitive():
    a = parse_rule('if gpu_memory_used >= 70gib for 1H30M then ALERT("big", SEVERITY="Critical")')
    b = parse_rule('IF gpu_memory_used >= 70GiB FOR 1h30m THEN alert("big", severity="critical")')
    assert a == b
    assert a.condition == Condition("gpu_memory_used", ">=", 70.0, "GiB", 5400)
    assert a.severity == "critical"


@pytest.mark.parametrize("op", [">", ">=", "<", "<=", "==", "!="])
def test_every_comparison_is_kept(op):
    rule = parse_rule(f'IF gpu_power {op} 250W THEN alert("P")')
    assert rule.condition == Condition("gpu_power", op, 250.0, "W")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("5m", 300), ("1h", 3600), ("1h30m", 5400), ("2d", 172800), ("1h0m5s", 3605)],
)
def test_durations(text, seconds):
    rule = parse_rule(f'IF gpu_utilization < 5% FOR {text} THEN alert("IDLE")')
    assert isinstance(rule.condition, Condition)
    assert rule.condition.for_seconds == seconds


def test_not_binds_tighter_than_and_which_binds_tighter_than_or():
    rule = parse_rule(
        'IF NOT gpu_temperature > 80C AND gpu_power > 100W OR gpu_utilization > 1% THEN alert("A")'
    )
    t, p, u = (
        Condition("gpu_temperature", ">", 80.0, "C"),
        Condition("gpu_power", ">", 100.0, "W"),
        Condition("gpu_utilization", ">", 1.0, "%"),
    )
    assert rule.condition == Or((And((Not(t), p)), u))


def test_parentheses_group_and_the_canonical_text_keeps_them():
    rule = parse_rule(
        'IF gpu_utilization > 90% AND (gpu_power > 300W OR gpu_temperature > 85C) THEN alert("HOT")'
    )
    assert isinstance(rule.condition, And)
    assert isinstance(rule.condition.operands[1], Or)
    assert "(gpu_power > 300W OR gpu_temperature > 85C)" in rule.to_text()
    assert parse_rule(rule.to_text()) == rule


def test_memory_thresholds_in_every_unit_convert_to_mib():
    for text, mib in [("2048MiB", 2048), ("2GiB", 2048), ("1TiB", 1024 * 1024)]:
        cond = parse_rule(f'IF gpu_memory_free < {text} THEN alert("LOW")').condition
        assert isinstance(cond, Condition)
        assert cond.base_value == mib
    cond = parse_rule('IF gpu_memory_used > 8GB THEN alert("X")').condition
    assert isinstance(cond, Condition)
    assert cond.base_value == pytest.approx(8e9 / 2**20)


def test_message_and_severity_keywords_in_any_order_with_escapes():
    rule = parse_rule(
        "IF gpu_utilization < 5% FOR 30m THEN "
        'alert(\'IDLE_GPU\', message="idle \\"GPU\\"\\nfree it", severity="critical")'
    )
    assert rule.action == Action("IDLE_GPU", "critical", 'idle "GPU"\nfree it')
    assert parse_rule(rule.to_text()) == rule


def test_a_rule_without_a_message_describes_its_condition():
    rule = parse_rule('IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU")')
    assert rule.message == "IDLE_GPU: gpu_utilization < 5% FOR 30m"


def test_many_rules_one_per_line_with_comments_and_blank_lines():
    rules = parse_rules(
        "# admin rules\n"
        '\nIF gpu_utilization > 90% FOR 5m THEN alert("HIGH_LOAD")  # busy\n'
        "   \n"
        'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU")\r\n'
    )
    assert [r.name for r in rules] == ["HIGH_LOAD", "IDLE_GPU"]
    assert parse_rules("") == []
    assert parse_rules("# nothing yet\n") == []


def test_canonical_text_is_a_fixed_point():
    text = 'if gpu_memory_used>95 % for 90s then alert("M",message="x")'
    canonical = parse_rule(text).to_text()
    assert canonical == (
        'IF gpu_memory_used > 95% FOR 1m30s THEN alert("M", severity="warning", message="x")'
    )
    assert parse_rule(canonical).to_text() == canonical


# -- errors: message, line, column, caret ------------------------------------------------------


def error_of(text: str, many: bool = False) -> RuleError:
    with pytest.raises(RuleError) as info:
        (parse_rules if many else parse_rule)(text)
    return info.value


def test_unknown_metric_names_the_known_ones_and_the_closest():
    e = error_of('IF gpu_utilisation > 90% THEN alert("A")')
    assert (e.line, e.column) == (1, 4)
    assert e.message.startswith(
        "unknown metric 'gpu_utilisation' (expected one of gpu_utilization,"
    )
    assert "did you mean gpu_utilization?" in e.message
    assert str(e).startswith("line 1, column 4: unknown metric 'gpu_utilisation'")
    excerpt = str(e).splitlines()
    assert excerpt[1] == '  IF gpu_utilisation > 90% THEN alert("A")'
    assert excerpt[2] == "     ^"


def test_unit_that_does_not_fit_the_metric():
    e = error_of('IF gpu_temperature > 5GiB THEN alert("A")')
    assert (e.line, e.column) == (1, 23)
    assert "'GiB' does not fit gpu_temperature" in e.message
    assert "C" in e.message


def test_missing_and_unknown_units():
    e = error_of('IF gpu_utilization > 90 THEN alert("A")')
    assert (e.column, e.message.split(":")[0]) == (22, "missing unit after 90")
    e = error_of('IF gpu_power > 90kW THEN alert("A")')
    assert e.column == 18 and e.message.startswith("unknown unit 'kW'")


def test_percentages_above_100_are_refused():
    e = error_of('IF gpu_memory_used > 120% THEN alert("A")')
    assert e.column == 22 and "more than 100%" in e.message


@pytest.mark.parametrize("duration", ["5x", "1.5h", "30m1h", "5mm", "1h1h"])
def test_bad_durations(duration):
    e = error_of(f'IF gpu_utilization > 90% FOR {duration} THEN alert("A")')
    assert e.column == 30
    assert e.message.startswith(f"bad duration '{duration}'")
    assert "1h30m" in e.message


def test_durations_over_30_days_are_refused():
    e = error_of('IF gpu_utilization > 90% FOR 31d THEN alert("A")')
    assert e.column == 30 and "longer than 30d" in e.message


def test_errors_on_later_lines_report_that_line():
    text = '# first\nIF gpu_utilization > 90% THEN alert("A")\n\nIF gpu_power > 9 THEN alert("B")\n'
    e = error_of(text, many=True)
    assert (e.line, e.column) == (4, 16)
    assert str(e).splitlines()[1] == '  IF gpu_power > 9 THEN alert("B")'


def test_syntax_errors_say_what_was_expected():
    e = error_of("IF gpu_utilization > 90%")
    assert (e.line, e.column) == (1, 25)
    assert e.message == "unexpected end of input (expected THEN, AND, OR or FOR)"
    e = error_of('IF (gpu_utilization > 90% THEN alert("A")')
    assert e.column == 27 and e.message == "unexpected 'THEN' (expected ')')"
    e = error_of('IF gpu_utilization = 90% THEN alert("A")')
    assert e.column == 20 and "use ==" in e.message
    e = error_of('IF gpu_utilization > 90% THEN alert("A')
    assert e.column == 37 and e.message == "unterminated string"


def test_action_errors():
    e = error_of('IF gpu_power > 1W THEN page("A")')
    assert e.column == 24 and e.message.startswith("unknown action 'page'")
    e = error_of('IF gpu_power > 1W THEN alert("A", sev="x")')
    assert e.column == 35 and "unknown argument 'sev'" in e.message
    e = error_of('IF gpu_power > 1W THEN alert("A", severity="fatal")')
    assert e.column == 44 and "unknown severity 'fatal'" in e.message
    e = error_of('IF gpu_power > 1W THEN alert("high load")')
    assert e.column == 30 and "alert name 'high load'" in e.message
    e = error_of("IF gpu_power > 1W THEN alert()")
    assert e.column == 30 and "needs the alert name" in e.message
    e = error_of('IF gpu_power > 1W THEN alert("A", message="x", message="y")')
    assert e.column == 48 and "message is given twice" in e.message


def test_parse_rule_wants_exactly_one_rule():
    assert error_of("# only a comment\n").message.startswith("expected a rule")
    e = error_of('IF gpu_power > 1W THEN alert("A")\nIF gpu_power > 2W THEN alert("B")')
    assert e.line == 2 and "found 2" in e.message


def test_deep_nesting_is_a_rule_error_not_a_crash():
    e = error_of("IF " + "(" * 500 + "gpu_power > 1W" + ")" * 500 + ' THEN alert("A")')
    assert "nested too deeply" in e.message
    e = error_of("IF " + "NOT " * 500 + 'gpu_power > 1W THEN alert("A")')
    assert "nested too deeply" in e.message


def test_rule_error_is_a_value_error_with_json():
    e = error_of('IF gpu_power > 1 THEN alert("A")')
    assert isinstance(e, ValueError)
    assert e.to_json() == {"message": e.message, "line": 1, "column": 16}


def test_rule_text_over_the_cap_is_refused_without_echoing_it():
    from gpulab.hub.alerts.parser import MAX_RULE_CHARS, MAX_RULES_TEXT_CHARS

    long_rule = 'IF gpu_utilization > 90% THEN alert("' + "X" * MAX_RULE_CHARS + '")'
    with pytest.raises(RuleError) as e:
        parse_rule(long_rule)
    assert e.value.message == (
        f"the rule text is {len(long_rule)} characters long; at most {MAX_RULE_CHARS} are read"
    )
    assert len(str(e.value)) < 200
    huge = "# comment\n" * (MAX_RULES_TEXT_CHARS // 10 + 1)
    with pytest.raises(RuleError, match="at most 65536 are read"):
        parse_rules(huge)
    with pytest.raises(RuleError) as e:
        parse_rules("# fine\n" + long_rule)
    assert (e.value.line, e.value.message) == (
        2,
        f"line 2 is {len(long_rule)} characters long; a rule has at most {MAX_RULE_CHARS}",
    )


def test_a_rule_has_at_most_32_conditions():
    from gpulab.hub.alerts.parser import MAX_CONDITIONS

    def rule(n: int) -> str:
        return "IF " + " AND ".join(["gpu_utilization > 50%"] * n) + ' THEN alert("MANY")'

    assert len(parse_rule(rule(MAX_CONDITIONS)).conditions()) == MAX_CONDITIONS
    text = rule(MAX_CONDITIONS + 1)
    with pytest.raises(RuleError) as e:
        parse_rule(text)
    assert e.value.message == "a rule has at most 32 conditions"
    assert e.value.column == text.rindex("gpu_utilization") + 1
