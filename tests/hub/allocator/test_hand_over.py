"""Hand-over: a warm pool member's reservation becomes the claiming user's share, same GPUs."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import (
    Allocator,
    InvalidRequest,
    NoCapacity,
    Quota,
    QuotaExceeded,
    Request,
    SQLiteStore,
)

from .conftest import assert_consistent

POOL = "gpulab:warm-pool"


def _reservation(rid: str = f"{POOL}/gpu-half-0") -> Request:
    return Request(rid, owner=POOL, gpu_milli=500, cpu_milli=1000, priority="preemptible")


def test_the_user_gets_the_members_gpus_and_the_member_holds_nothing(small_inventory):
    alloc = Allocator(small_inventory)
    seen: list[dict[str, str]] = []
    alloc.add_listener(lambda held, removed: seen.append(dict(removed)))
    reserved = alloc.place(_reservation())
    mine = alloc.hand_over(
        reserved.id, Request("alice/", owner="alice", gpu_milli=500, cpu_milli=1000)
    )
    assert (mine.node, mine.gpus) == (reserved.node, reserved.gpus)
    assert mine.request.owner == "alice" and not mine.request.preemptible
    assert alloc.get(reserved.id) is None and alloc.get("alice/") == mine
    assert alloc.usage_milli("alice") == 500 and alloc.usage_milli(POOL) == 0
    assert seen[-1] == {reserved.id: "handed-over"}
    assert_consistent(alloc)


def test_a_hand_over_is_persisted(small_inventory, tmp_path):
    url = f"sqlite:///{tmp_path / 'a.sqlite'}"
    alloc = Allocator(small_inventory, store=SQLiteStore(url))
    reserved = alloc.place(_reservation())
    alloc.hand_over(reserved.id, Request("alice/", owner="alice", gpu_milli=500, cpu_milli=1000))
    again = Allocator(small_inventory, store=SQLiteStore(url))
    assert [p.id for p in again.allocations()] == ["alice/"]
    assert again.get("alice/").gpus == reserved.gpus
    assert_consistent(again)


def test_another_shape_is_refused_and_changes_nothing(small_inventory):
    alloc = Allocator(small_inventory)
    reserved = alloc.place(_reservation())
    with pytest.raises(InvalidRequest, match="same profile"):
        alloc.hand_over(reserved.id, Request("alice/", owner="alice", num_gpu=1))
    assert alloc.get(reserved.id) == reserved and alloc.get("alice/") is None
    assert_consistent(alloc)


def test_over_quota_is_refused_and_the_member_keeps_its_reservation(small_inventory):
    alloc = Allocator(small_inventory, quota=Quota(users={"alice": 250}))
    reserved = alloc.place(_reservation())
    with pytest.raises(QuotaExceeded):
        alloc.hand_over(
            reserved.id, Request("alice/", owner="alice", gpu_milli=500, cpu_milli=1000)
        )
    assert alloc.get(reserved.id) == reserved and alloc.usage_milli("alice") == 0
    assert_consistent(alloc)


def test_a_member_released_meanwhile_hands_over_nothing(small_inventory):
    alloc = Allocator(small_inventory)
    reserved = alloc.place(_reservation())
    alloc.release(reserved.id, "preempted")
    with pytest.raises(NoCapacity, match="released meanwhile"):
        alloc.hand_over(
            reserved.id, Request("alice/", owner="alice", gpu_milli=500, cpu_milli=1000)
        )
    assert alloc.allocations() == []
