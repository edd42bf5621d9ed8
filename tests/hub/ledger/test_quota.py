"""GPU-hour budgets over a window: parsing, standing, the tightest budget, burn-down."""

from __future__ import annotations

import pytest

from gpulab.hub.ledger import HourQuota, HourQuotaError, Interval, budgets, burn_down, tightest
from gpulab.hub.ledger.quota import (
    EXHAUSTED,
    OK,
    WARN,
    allocated_milli_seconds,
    hours_until_exhausted,
)

from .test_model import holding


def test_budgets_count_allocated_gpu_hours_in_the_window_per_user_and_group():
    quota = HourQuota.parse({"alice": 10}, {"ml": "25.5"}, window_days=7)
    week = 7 * 86400
    intervals = [
        Interval(1, holding("alice/", milli=500, groups=("ml",)), start=0, end=16 * 3600),  # 8 h
        Interval(2, holding("bob/", milli=1000, groups=("ml",)), start=0, end=20 * 3600),  # 20 h
        Interval(3, holding("alice/old", milli=1000), start=-10 * 86400, end=-9 * 86400),  # outside
    ]
    users, groups = allocated_milli_seconds(intervals, since=0, until=week)
    found = budgets(quota, "alice", ["ml", "other"], users, groups)
    assert [(b.scope, b.name, b.allocated_gpu_hours, b.state) for b in found] == [
        ("user", "alice", 8.0, WARN),
        ("group", "ml", 28.0, EXHAUSTED),
    ]
    assert tightest(found).name == "ml"
    assert found[0].remaining_gpu_hours == 2.0
    assert found[0].describe() == "alice: 8.0 of 10 GPU-hours allocated, 2.0 left"
    assert budgets(quota, "carol", [], users, groups) == []
    (bob,) = budgets(HourQuota.parse({"bob": 100}, {}, 30), "bob", [], users, groups)
    assert bob.state == OK


def test_hours_until_exhausted_at_the_current_holding():
    (b,) = budgets(HourQuota.parse({"a": 10}, {}, 1), "a", [], {"a": 6 * 3600 * 1000}, {})
    assert hours_until_exhausted(b, 250) == 16.0
    assert hours_until_exhausted(b, 0) is None


def test_burn_down_falls_by_what_is_held():
    intervals = [Interval(1, holding(milli=1000), start=0, end=7200)]
    assert burn_down(intervals, 5.0, since=0, until=10800, step=3600) == [
        (0, 5.0),
        (3600, 4.0),
        (7200, 3.0),
        (10800, 3.0),
    ]


@pytest.mark.parametrize(
    ("users", "groups", "days", "field"),
    [
        ({"a": -1}, {}, 30, "users['a']"),
        ({}, {"g": "lots"}, 30, "groups['g']"),
        ({"a": True}, {}, 30, "users['a']"),
        ({}, {}, 0, "window_days"),
        ({}, {}, "30", "window_days"),
    ],
)
def test_a_quota_names_the_field_it_cannot_read(users, groups, days, field):
    with pytest.raises(HourQuotaError, match=field.replace("[", r"\[").replace("]", r"\]")):
        HourQuota.parse(users, groups, days)
