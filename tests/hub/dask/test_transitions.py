"""The state machines of clusters and workers: the tables, the guards and what events carry."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.allocator import GpuShare
from gpulab.hub.dask import (
    CLUSTER_TRANSITIONS,
    FINAL_CLUSTER_STATES,
    FINAL_WORKER_STATES,
    HOLDING_WORKER_STATES,
    WORKER_TRANSITIONS,
    Adapt,
    AdmitWorker,
    Cluster,
    ClusterSpecError,
    ClusterState,
    Exited,
    IllegalTransition,
    Joined,
    Launch,
    Preempted,
    Ready,
    Retire,
    Scale,
    SetKeepAlive,
    Stop,
    Stopped,
    Wait,
    Worker,
    WorkerFailed,
    WorkerState,
    transition_cluster,
    transition_worker,
)
from gpulab.hub.jobs import PlacementSummary

from .conftest import make_spec

PLACED = PlacementSummary("n1", (GpuShare("GPU-0", 250),))
CLUSTER_EVENTS = [
    Launch(1, PLACED),
    Ready(1, "tls://10.0.0.1:8786", "/dask/1/status"),
    Scale(1, 3),
    Adapt(1, 0, 4),
    SetKeepAlive(1, True),
    Stop(1),
    Stopped(1),
]
WORKER_EVENTS = [
    AdmitWorker(1, PLACED),
    Wait(1, "waiting for a free 1/4 GPU"),
    Joined(1),
    Retire(1),
    Exited(1),
    WorkerFailed(1),
    Preempted(1),
]


def new_cluster() -> Cluster:
    return Cluster.created(7, make_spec(n_workers=2, keep_alive=False), at=0.0)


def test_a_cluster_starts_runs_and_stops():
    cluster = new_cluster()
    assert (cluster.state, cluster.target, cluster.version) == (ClusterState.PENDING, 2, 0)
    cluster = transition_cluster(cluster, Launch(1.0, PLACED))
    assert cluster.state is ClusterState.STARTING and cluster.scheduler == PLACED
    cluster = transition_cluster(cluster, Ready(2.0, "tls://10.0.0.1:8786", "/dask/7/status"))
    assert cluster.state is ClusterState.RUNNING
    assert cluster.scheduler_address == "tls://10.0.0.1:8786"
    cluster = transition_cluster(cluster, Stop(3.0, reason="stopped by its owner"))
    assert cluster.state is ClusterState.STOPPING and not cluster.is_live
    cluster = transition_cluster(cluster, Stopped(4.0))
    assert cluster.state is ClusterState.STOPPED
    assert (cluster.version, cluster.updated_at, cluster.reason) == (4, 4.0, "stopped by its owner")


def test_a_cluster_stopped_for_a_failure_ends_failed():
    cluster = transition_cluster(new_cluster(), Stop(1.0, reason="scheduler exited", failed=True))
    assert transition_cluster(cluster, Stopped(2.0)).state is ClusterState.FAILED


def test_scaling_by_hand_ends_adaptive_scaling_and_adapt_starts_it():
    cluster = transition_cluster(new_cluster(), Adapt(1.0, 1, 6))
    assert (cluster.adaptive, cluster.minimum, cluster.maximum) == (True, 1, 6)
    cluster = transition_cluster(cluster, Scale(2.0, 4))
    assert (cluster.adaptive, cluster.target) == (False, 4)
    assert cluster.state is ClusterState.PENDING  # settings change no state


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (Scale(1.0, -1), "n_workers"),
        (Scale(1.0, 10_000), "n_workers"),
        (Adapt(1.0, 3, 2), "maximum"),
        (Adapt(1.0, -1, 2), "minimum"),
        (SetKeepAlive(1.0, "no"), "keep_alive"),  # type: ignore[arg-type]
    ],
)
def test_bad_settings_are_refused_naming_the_field(event, field):
    with pytest.raises(ClusterSpecError) as caught:
        transition_cluster(new_cluster(), event)
    assert caught.value.field == field


def test_keep_alive_can_be_toggled_while_the_cluster_lives():
    cluster = transition_cluster(new_cluster(), SetKeepAlive(1.0, True))
    assert cluster.keep_alive
    stopping = transition_cluster(cluster, Stop(2.0))
    with pytest.raises(IllegalTransition, match="stopping: SetKeepAlive is not allowed"):
        transition_cluster(stopping, SetKeepAlive(3.0, False))


@pytest.mark.parametrize("state", list(ClusterState))
@pytest.mark.parametrize("event", CLUSTER_EVENTS, ids=lambda e: type(e).__name__)
def test_the_cluster_table_is_the_whole_truth(state, event):
    from dataclasses import replace

    cluster = replace(new_cluster(), state=state)
    if (state, type(event)) in CLUSTER_TRANSITIONS:
        assert transition_cluster(cluster, event).version == cluster.version + 1
    else:
        with pytest.raises(IllegalTransition) as caught:
            transition_cluster(cluster, event)
        assert state.value in caught.value.reason


def test_final_cluster_states_accept_nothing():
    assert not [key for key in CLUSTER_TRANSITIONS if key[0] in FINAL_CLUSTER_STATES]


def new_worker() -> Worker:
    return Worker(cluster_id=7, number=3, state=WorkerState.PENDING, created_at=0.0)


def test_a_worker_is_admitted_joins_retires_and_exits():
    worker = transition_worker(new_worker(), Wait(1.0, "waiting for a free 1/4 GPU"))
    assert (worker.state, worker.reason) == (WorkerState.PENDING, "waiting for a free 1/4 GPU")
    worker = transition_worker(worker, AdmitWorker(2.0, PLACED))
    assert (worker.state, worker.placement, worker.reason) == (WorkerState.ADMITTED, PLACED, "")
    worker = transition_worker(worker, Joined(3.0))
    worker = transition_worker(worker, Retire(4.0, reason="scaled down"))
    assert worker.state is WorkerState.RETIRING
    worker = transition_worker(worker, Exited(5.0))
    assert (worker.state, worker.reason, worker.placement) == (
        WorkerState.STOPPED,
        "scaled down",
        PLACED,  # kept for the history
    )


def test_a_pending_worker_retires_at_once_having_held_nothing():
    assert transition_worker(new_worker(), Retire(1.0)).state is WorkerState.STOPPED


@pytest.mark.parametrize("start", sorted(HOLDING_WORKER_STATES, key=lambda s: s.value))
def test_a_placed_worker_can_fail_or_be_preempted_from_every_holding_state(start):
    from dataclasses import replace

    worker = replace(new_worker(), state=start, placement=PLACED)
    assert transition_worker(worker, WorkerFailed(1.0, "exit code 1")).reason == "exit code 1"
    assert transition_worker(worker, Preempted(1.0)).state is WorkerState.PREEMPTED


@pytest.mark.parametrize("state", list(WorkerState))
@pytest.mark.parametrize("event", WORKER_EVENTS, ids=lambda e: type(e).__name__)
def test_the_worker_table_is_the_whole_truth(state, event):
    from dataclasses import replace

    worker = replace(new_worker(), state=state)
    if (state, type(event)) in WORKER_TRANSITIONS:
        assert transition_worker(worker, event).version == worker.version + 1
    else:
        with pytest.raises(IllegalTransition) as caught:
            transition_worker(worker, event)
        assert "w3 of cluster 7" in caught.value.reason


@given(st.lists(st.sampled_from(WORKER_EVENTS), max_size=12))
def test_any_worker_history_moves_only_along_the_table(events):
    worker = new_worker()
    for event in events:
        before = worker
        try:
            worker = transition_worker(worker, event)
        except IllegalTransition:
            assert (before.state, type(event)) not in WORKER_TRANSITIONS
            continue
        assert WORKER_TRANSITIONS[(before.state, type(event))] is worker.state
        assert worker.version == before.version + 1
        # a worker holds a placement from its admission on, and nothing before
        assert (worker.placement is None) == (
            before.placement is None and not isinstance(event, AdmitWorker)
        )
        assert before.state not in FINAL_WORKER_STATES
