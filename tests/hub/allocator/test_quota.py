"""Quotas: exact milli-GPU budgets per user and group, over-quota spot work."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import Allocator, Quota, QuotaExceeded, Request


def test_eight_eighths_make_exactly_one_gpu_of_budget(small_inventory):
    alloc = Allocator(small_inventory, quota=Quota(users={"alice": 1000}))
    for k in range(8):
        alloc.place(Request(f"alice/{k}", owner="alice", gpu_milli=125))
    assert alloc.usage_milli("alice") == 1000
    assert alloc.quota_left_milli("alice", frozenset()) == 0
    with pytest.raises(QuotaExceeded) as err:
        alloc.place(Request("alice/9", owner="alice", gpu_milli=1))
    assert "alice" in err.value.reason


def test_release_gives_budget_back(small_inventory):
    alloc = Allocator(small_inventory, quota=Quota(users={"alice": 1000}))
    alloc.place(Request("alice/a", owner="alice", num_gpu=1))
    alloc.release("alice/a")
    assert alloc.quota_left_milli("alice", frozenset()) == 1000
    alloc.place(Request("alice/b", owner="alice", num_gpu=1))


def test_group_budget_is_shared_by_members(small_inventory):
    quota = Quota(groups={"students": 1500})
    alloc = Allocator(small_inventory, quota=quota)
    students = frozenset({"students"})
    alloc.place(Request("a/x", owner="a", groups=students, num_gpu=1))
    assert alloc.quota_left_milli("b", students) == 500
    with pytest.raises(QuotaExceeded) as err:
        alloc.place(Request("b/x", owner="b", groups=students, num_gpu=1))
    assert "students" in err.value.reason
    alloc.place(Request("b/y", owner="b", groups=students, gpu_milli=500))


def test_default_user_budget_applies_to_unlisted_users(small_inventory):
    alloc = Allocator(small_inventory, quota=Quota(users={"boss": 8000}, default_user_milli=500))
    with pytest.raises(QuotaExceeded):
        alloc.place(Request("eve/x", owner="eve", num_gpu=1))
    alloc.place(Request("boss/x", owner="boss", num_gpu=4))
    assert alloc.quota_left_milli("nobody-special", frozenset()) == 500


def test_unlimited_user_has_no_quota_left_value(small_inventory):
    alloc = Allocator(small_inventory)
    assert alloc.quota_left_milli("anyone", frozenset()) is None


def test_preemptible_work_may_run_over_quota_and_is_not_counted(small_inventory):
    alloc = Allocator(small_inventory, quota=Quota(users={"alice": 1000}))
    alloc.place(Request("alice/a", owner="alice", num_gpu=1))
    spot = alloc.place(Request("alice/spot", owner="alice", num_gpu=2, priority="preemptible"))
    assert spot.over_quota
    assert alloc.usage_milli("alice") == 3000
    assert alloc.quota_left_milli("alice", frozenset()) == 0


def test_over_quota_preemptible_is_refused_when_not_allowed(small_inventory):
    quota = Quota(users={"alice": 1000}, allow_preemptible_over_quota=False)
    alloc = Allocator(small_inventory, quota=quota)
    with pytest.raises(QuotaExceeded):
        alloc.place(Request("alice/spot", owner="alice", num_gpu=2, priority="preemptible"))


def test_negative_budget_is_a_config_error():
    with pytest.raises(ValueError, match="alice"):
        Quota(users={"alice": -1})
