"""Scaling decisions: targets within limits and quota, and which workers go first."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.allocator import GpuShare
from gpulab.hub.dask import (
    ACTIVE_WORKER_STATES,
    Adapt,
    Cluster,
    ScalePlan,
    Worker,
    WorkerState,
    active,
    adaptive_within_quota,
    desired_count,
    most_workers_within,
    plan_scale,
    quota_refusal,
    retire_order,
    transition_cluster,
)
from gpulab.hub.jobs import PlacementSummary

from .conftest import make_spec


def worker(number: int, state: WorkerState, over_quota: bool = False) -> Worker:
    placement = None
    if state is not WorkerState.PENDING:
        placement = PlacementSummary("n1", (GpuShare(f"GPU-{number}", 250),), over_quota)
    return Worker(7, number, state, created_at=float(number), placement=placement)


workers_strategy = st.lists(
    st.tuples(st.sampled_from(list(WorkerState)), st.booleans()), max_size=20
).map(lambda specs: [worker(i, s, o) for i, (s, o) in enumerate(specs, start=1)])


def test_a_cluster_below_its_target_adds_workers():
    workers = [worker(1, WorkerState.RUNNING), worker(2, WorkerState.STOPPED)]
    assert plan_scale(workers, 3) == ScalePlan(add=2)  # the stopped one does not count
    assert plan_scale(workers, 1).empty


def test_scale_down_drops_pending_then_unstarted_then_running_workers():
    workers = [
        worker(1, WorkerState.RUNNING),
        worker(2, WorkerState.RUNNING),
        worker(3, WorkerState.ADMITTED),
        worker(4, WorkerState.PENDING),
        worker(5, WorkerState.RETIRING),  # leaving already: neither counted nor chosen
    ]
    assert plan_scale(workers, 3).retire == (4,)
    assert plan_scale(workers, 2).retire == (4, 3)
    assert plan_scale(workers, 0).retire == (4, 3, 2, 1)  # the youngest running one first


def test_running_workers_go_over_quota_first_then_as_the_scheduler_suggests():
    workers = [
        worker(1, WorkerState.RUNNING),
        worker(2, WorkerState.RUNNING),
        worker(3, WorkerState.RUNNING, over_quota=True),
        worker(4, WorkerState.RUNNING),
    ]
    order = [w.number for w in retire_order(workers, close_first=["w1", "w2"])]
    assert order == [3, 1, 2, 4]


@given(workers=workers_strategy, target=st.integers(0, 25), suggested=st.permutations(range(25)))
def test_a_plan_reaches_the_target_exactly(workers, target, suggested):
    plan = plan_scale(workers, target, close_first=[f"w{i}" for i in suggested])
    current = active(workers)
    assert not (plan.add and plan.retire)
    assert len(current) + plan.add - len(plan.retire) == target
    retired = {w.number: w for w in current if w.number in plan.retire}
    assert len(retired) == len(plan.retire)  # only active workers, each once
    kept = [w for w in current if w.number not in retired]
    # nothing retired while a worker of an earlier stage (pending < admitted < running) stays
    stage = {WorkerState.PENDING: 0, WorkerState.ADMITTED: 1, WorkerState.RUNNING: 2}
    if retired and kept:
        assert max(stage[w.state] for w in retired.values()) <= min(stage[w.state] for w in kept)


def test_a_negative_target_is_a_bug():
    with pytest.raises(ValueError, match=">= 0"):
        plan_scale([], -1)


def cluster(**changes: object) -> Cluster:
    return replace(Cluster.created(7, make_spec(n_workers=2), 0.0), **changes)  # type: ignore[arg-type]


def test_the_desired_count_is_the_manual_target_or_the_scheduler_s_within_limits():
    assert desired_count(cluster(target=5), current=2, scheduler_target=40) == 5
    adaptive = transition_cluster(cluster(), Adapt(1.0, 1, 8))
    assert desired_count(adaptive, current=2, scheduler_target=None) == 2  # not answered yet
    assert desired_count(adaptive, current=2, scheduler_target=40) == 8
    assert desired_count(adaptive, current=2, scheduler_target=0) == 1


def test_adaptive_scaling_asks_for_no_worker_that_could_only_wait_for_quota():
    placed = [worker(1, WorkerState.RUNNING), worker(2, WorkerState.ADMITTED)]
    waiting = [*placed, worker(3, WorkerState.PENDING)]
    assert adaptive_within_quota(10, waiting, room=3, minimum=0) == 5
    assert adaptive_within_quota(10, waiting, room=None, minimum=0) == 10
    assert adaptive_within_quota(10, waiting, room=0, minimum=4) == 4  # the minimum stays


def test_quota_room_counts_whole_workers():
    assert most_workers_within(1000, 250) == 4
    assert most_workers_within(999, 250) == 3
    assert most_workers_within(-5, 250) == 0
    assert most_workers_within(None, 250) is None
    assert most_workers_within(1000, 0) is None  # a CPU-only worker uses no GPU quota


def test_a_scale_beyond_quota_is_refused_naming_the_limit_and_the_most_that_fit():
    message = quota_refusal(
        n=8, worker_milli=250, left_milli=1000, held_milli=500, limit="the quota of group students"
    )
    assert message == (
        "8 workers of 0.25 GPU need 2 GPUs, more than the 1.5 GPUs the quota of group students "
        "leaves for this cluster: at most 6 workers"
    )
    assert quota_refusal(n=6, worker_milli=250, left_milli=1000, held_milli=500) is None
    assert quota_refusal(n=99, worker_milli=250, left_milli=None) is None
    assert "at most 1 worker" in (quota_refusal(n=2, worker_milli=500, left_milli=500) or "")


@given(
    n=st.integers(0, 256),
    worker_milli=st.integers(1, 8000),
    left=st.integers(-2000, 20_000),
    held=st.integers(0, 8000),
)
def test_quota_refusal_agrees_with_the_room_it_names(n, worker_milli, left, held):
    refusal = quota_refusal(n=n, worker_milli=worker_milli, left_milli=left, held_milli=held)
    most = most_workers_within(max(0, left) + held, worker_milli)
    assert most is not None
    assert (refusal is None) == (n <= most)
    if refusal is not None:
        assert f"at most {most} worker" in refusal


def test_only_pending_admitted_and_running_workers_are_active():
    states = {w.state for w in active([worker(i, s) for i, s in enumerate(WorkerState)])}
    assert states == ACTIVE_WORKER_STATES
