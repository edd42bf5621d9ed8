"""Preemption: the cheapest set of preemptible victims, never on-demand work."""

from __future__ import annotations

import itertools

import pytest

from gpulab.hub.allocator import Allocator, Inventory, NoCapacity, Quota, Request


def clocked(inv, **kw):
    ticks = itertools.count(1000)
    return Allocator(inv, policy="first-fit", clock=lambda: float(next(ticks)), **kw)


def spot(rid, **kw):
    return Request(rid, priority="preemptible", **kw)


def test_nothing_is_preempted_when_the_request_fits(small_inventory):
    alloc = clocked(small_inventory)
    alloc.place(spot("s", num_gpu=1))
    assert alloc.propose_preemption(Request("od", num_gpu=1)) == []


def test_fewest_victims_win(make_node):
    inv = Inventory([make_node("n1", gpus=2), make_node("n2", gpus=2)])
    alloc = clocked(inv)
    alloc.place(spot("one-a", gpu_milli=500))
    alloc.place(spot("one-b", gpu_milli=500))  # same GPU as one-a
    alloc.place(spot("one-c", num_gpu=1))
    alloc.place(spot("two", num_gpu=2))  # n2, a single victim frees both
    victims = alloc.propose_preemption(Request("od", num_gpu=2))
    assert [v.id for v in victims] == ["two"]


def test_youngest_victim_wins_among_equals(make_node):
    inv = Inventory([make_node("n1", gpus=4)])
    alloc = clocked(inv)
    for k in range(4):
        alloc.place(spot(f"s{k}", num_gpu=1))
    victims = alloc.propose_preemption(Request("od", num_gpu=1))
    assert [v.id for v in victims] == ["s3"]


def test_over_quota_spot_work_is_reclaimed_first(make_node):
    inv = Inventory([make_node("n1", gpus=2)])
    alloc = clocked(inv, quota=Quota(users={"bob": 1000}))
    alloc.place(spot("bob/in", owner="bob", num_gpu=1))
    over = alloc.place(spot("bob/over", owner="bob", num_gpu=1))
    assert over.over_quota
    # bob/in is younger? no: bob/over is younger; make an in-quota younger one elsewhere
    victims = alloc.propose_preemption(Request("od", num_gpu=1))
    assert [v.id for v in victims] == ["bob/over"]


def test_over_quota_beats_youth(make_node):
    inv = Inventory([make_node("n1", gpus=2)])
    alloc = clocked(inv, quota=Quota(users={"bob": 1000}, default_user_milli=None))
    alloc.place(spot("carol/in-old", owner="carol", num_gpu=0, cpu_milli=1))  # filler, no GPU
    alloc.place(spot("bob/x", owner="bob", num_gpu=1))  # in quota
    alloc.place(spot("bob/y", owner="bob", num_gpu=1))  # over quota
    alloc.release("bob/x")
    alloc.place(spot("bob/z", owner="bob", num_gpu=1))  # in quota again, youngest
    victims = alloc.propose_preemption(Request("od", num_gpu=1))
    assert [v.id for v in victims] == ["bob/y"]


def test_on_demand_work_is_never_preempted(make_node):
    inv = Inventory([make_node("n1", gpus=2)])
    alloc = clocked(inv)
    alloc.place(Request("od1", num_gpu=1))
    alloc.place(spot("s", gpu_milli=500))
    with pytest.raises(NoCapacity):
        alloc.propose_preemption(Request("od2", num_gpu=2))
    victims = alloc.propose_preemption(Request("od3", num_gpu=1))
    assert [v.id for v in victims] == ["s"]


def test_preemptible_requests_do_not_preempt(make_node):
    inv = Inventory([make_node("n1", gpus=1)])
    alloc = clocked(inv)
    alloc.place(spot("s", num_gpu=1))
    with pytest.raises(NoCapacity, match="do not preempt"):
        alloc.propose_preemption(spot("s2", num_gpu=1))


def test_preempt_and_place_swaps_atomically(tmp_path, make_node):
    inv = Inventory([make_node("n1", gpus=2)])
    url = f"sqlite:///{tmp_path}/a.sqlite"
    alloc = Allocator.open(inv, url)
    alloc.place(spot("s1", num_gpu=1))
    alloc.place(spot("s2", gpu_milli=250))
    placement, victims = alloc.preempt_and_place(Request("od", num_gpu=2))
    assert {v.id for v in victims} == {"s1", "s2"}
    assert [p.id for p in alloc.allocations()] == ["od"]
    alloc.store.close()
    assert [p.id for p in Allocator.open(inv, url).allocations()] == ["od"]
    assert placement.node == "n1"


def test_victims_must_free_cpu_too(make_node):
    inv = Inventory([make_node("n1", gpus=2, cpu_milli=10_000)])
    alloc = clocked(inv)
    alloc.place(spot("gpu-only", num_gpu=1))
    alloc.place(spot("cpu-hog", cpu_milli=9000))
    victims = alloc.propose_preemption(Request("od", num_gpu=1, cpu_milli=5000))
    assert [v.id for v in victims] == ["cpu-hog"]


def test_only_evictable_placements_are_victims(make_node):
    inv = Inventory([make_node("n1", gpus=2)])
    alloc = clocked(inv)
    alloc.place(spot("ann/job-1", num_gpu=1))
    alloc.place(spot("ann/", num_gpu=1))  # younger, so the cheaper victim when all may go
    assert [v.id for v in alloc.propose_preemption(Request("od", num_gpu=1))] == ["ann/"]

    def jobs_only(p):
        return "/job-" in p.request.id

    placement, victims = alloc.preempt_and_place(Request("od", num_gpu=1), jobs_only)
    assert [v.id for v in victims] == ["ann/job-1"]
    assert {p.request.id for p in alloc.allocations()} == {"ann/", "od"}
    with pytest.raises(NoCapacity):  # what is left is no job: nothing may be evicted
        alloc.preempt_and_place(Request("od2", num_gpu=1), jobs_only)
