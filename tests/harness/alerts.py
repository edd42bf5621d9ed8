"""Hypothesis strategies for alert rules: conditions, expressions over them, and actions, shared by
the rule language's property tests and its Prometheus export tests."""

from __future__ import annotations

from hypothesis import strategies as st

from gpulab.hub.alerts import Action, And, Condition, Not, Or
from gpulab.hub.alerts.model import METRICS, SEVERITIES


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
