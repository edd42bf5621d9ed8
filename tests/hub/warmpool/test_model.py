"""Warm pool configuration and planning (pure)."""

from __future__ import annotations

from datetime import datetime

import pytest

from gpulab.hub.warmpool import (
    Member,
    PoolConfigError,
    PoolSpec,
    is_pool_allocation,
    member_allocation_id,
    parse_pools,
    parse_schedule,
    plan,
)

PROFILES = ["cpu", "gpu-quarter", "gpu-1"]
# 2026-12-07 is a Monday
MONDAY_9 = datetime(2026, 12, 7, 9, 0)
MONDAY_20 = datetime(2026, 12, 7, 20, 0)
SATURDAY_9 = datetime(2026, 12, 12, 9, 0)


def test_a_pool_with_no_schedule_is_always_on_and_grows_with_claims_up_to_max():
    (spec,) = parse_pools([{"profile": "gpu-quarter", "min": 2, "max": 4}], PROFILES)
    assert spec == PoolSpec("gpu-quarter", 2, 4)
    assert [spec.desired(SATURDAY_9, n) for n in (0, 1, 2, 5)] == [2, 3, 4, 4]


def test_a_schedule_turns_the_pool_off_outside_its_windows():
    spec = PoolSpec("gpu-1", 3, 3, parse_schedule("mon-fri 08:00-19:00"))
    assert spec.desired(MONDAY_9, 0) == 3
    assert spec.desired(MONDAY_20, 5) == 0
    assert spec.desired(SATURDAY_9, 0) == 0


def test_windows_past_midnight_lists_and_day_ranges_that_wrap():
    (night,) = parse_schedule("fri 22:00-02:00")
    assert night.covers(datetime(2026, 12, 11, 23, 0))  # Friday night
    assert night.covers(datetime(2026, 12, 12, 1, 30))  # Saturday early morning
    assert not night.covers(datetime(2026, 12, 12, 2, 0))
    assert not night.covers(datetime(2026, 12, 10, 23, 0))  # Thursday
    (weekend,) = parse_schedule(["sat-sun 10:00-12:00"])
    assert weekend.days == frozenset({5, 6})
    (wrapped,) = parse_schedule("sun-tue 10:00-24:00")
    assert wrapped.days == frozenset({6, 0, 1}) and wrapped.end_minute == 0
    assert len(parse_schedule("mon 08:00-10:00; wed 08:00-10:00")) == 2
    assert parse_schedule("always") == () == parse_schedule(None)


@pytest.mark.parametrize(
    ("entries", "where", "words"),
    [
        ("gpu-1", "GPUWarmPool.pools", "list of pools"),
        ([{"profile": "gpu-9"}], "pools[0].profile", "not a profile"),
        ([{"profile": "gpu-1", "size": 2}], "pools[0]", "unknown key"),
        ([{"profile": "gpu-1", "min": 3, "max": 2}], "pools[0].max", "below min"),
        ([{"profile": "gpu-1", "min": -1}], "pools[0].min", "whole number"),
        ([{"profile": "gpu-1", "min": True}], "pools[0].min", "whole number"),
        ([{"profile": "gpu-1"}, {"profile": "gpu-1"}], "pools[1].profile", "has a pool"),
        ([{"profile": "gpu-1", "schedule": "weekdays 8-19"}], "pools[0].schedule", "window"),
        ([{"profile": "gpu-1", "schedule": "mon-fry 08:00-19:00"}], "schedule", "not a day"),
        ([{"profile": "gpu-1", "schedule": "mon 25:00-26:00"}], "schedule", "time of day"),
        ([{"profile": "gpu-1", "schedule": "mon 08:00-08:00"}], "schedule", "same time"),
    ],
)
def test_a_mistake_names_the_entry_and_says_what_is_wrong(entries, where, words):
    with pytest.raises(PoolConfigError) as e:
        parse_pools(entries, PROFILES)
    assert where in str(e.value) and words in str(e.value)


def test_member_ids_never_look_like_a_users_server():
    member = member_allocation_id("gpu-1", 7)
    assert is_pool_allocation(member)
    assert not is_pool_allocation("alice/") and not is_pool_allocation("alice/gpu-1")


def _member(i: int, fingerprint: str = "a", ready: bool = True) -> Member:
    return Member(f"m{i}", "gpu-1", fingerprint, ready, started_at=float(i))


def test_the_plan_starts_what_is_missing():
    assert plan(3, [_member(1)], "a").start == 2
    assert plan(0, [], "a").start == 0


def test_stale_members_are_stopped_and_replaced():
    decided = plan(2, [_member(1, "old"), _member(2)], "a")
    assert decided.stop == ("m1",) and decided.reasons == {"m1": "stale"}
    assert decided.start == 1


def test_surplus_goes_starting_members_first_then_the_newest_ready():
    members = [_member(1), _member(2), _member(3, ready=False), _member(4)]
    decided = plan(2, members, "a")
    assert set(decided.stop) == {"m3", "m4"}
    assert decided.start == 0 and set(decided.reasons.values()) == {"surplus"}
