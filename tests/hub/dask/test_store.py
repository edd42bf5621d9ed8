"""The cluster store's contract, on SQLite and on a real PostgreSQL server alike."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from gpulab.hub.allocator import GpuShare
from gpulab.hub.dask import (
    SCHEMA_VERSION,
    AdmitWorker,
    ClusterEnded,
    ClusterNameTaken,
    ClusterNotFound,
    ClusterState,
    ClusterStore,
    Exited,
    IllegalTransition,
    Joined,
    Launch,
    Ready,
    Retire,
    SetKeepAlive,
    Stop,
    Stopped,
    WorkerState,
    sqlite_url,
)
from gpulab.hub.jobs import PlacementSummary, SchemaTooNew, make_engine

from .conftest import make_spec

PLACED = PlacementSummary("n1", (GpuShare("GPU-0", 250),))
SCHEDULER = PlacementSummary("n1", ())


def test_a_created_cluster_is_stored_pending_with_its_spec(store):
    spec = make_spec(environment={"OMP_NUM_THREADS": "2"}, server="gpu", keep_alive=True)
    cluster = store.create(spec)
    assert cluster.state is ClusterState.PENDING
    assert store.get(cluster.id) == cluster
    assert store.find("alice", "etl") == cluster
    assert store.find("bob", "etl") is None
    assert store.list_clusters(owner="alice") == [cluster]
    assert store.list_clusters(owner="bob") == []
    with pytest.raises(ClusterNotFound):
        store.get(cluster.id + 1)


def test_a_live_name_is_one_cluster_s_and_free_again_once_it_ended(store):
    first = store.create(make_spec())
    with pytest.raises(ClusterNameTaken) as taken:
        store.create(make_spec(n_workers=5))
    assert taken.value.field == "name"
    store.create(make_spec(owner="bob"))  # names are per owner
    stopping = store.transition(first.id, Stop(1.0), expected_state=ClusterState.PENDING)
    assert stopping is not None
    with pytest.raises(ClusterNameTaken):  # still stopping: its processes may still run
        store.create(make_spec())
    store.transition(first.id, Stopped(2.0), expected_state=ClusterState.STOPPING)
    again = store.create(make_spec())
    assert again.id > first.id  # ids are never reused
    assert store.find("alice", "etl") == again
    assert [c.id for c in store.list_clusters(owner="alice", states={ClusterState.STOPPED})] == [
        first.id
    ]


def test_transitions_are_stored_and_compare_and_set(store):
    cluster = store.create(make_spec())
    launched = store.transition(
        cluster.id, Launch(1.0, SCHEDULER), expected_state=ClusterState.PENDING
    )
    assert launched is not None and store.get(cluster.id) == launched
    # a writer that decided from the pending copy lost: nothing is written
    assert store.transition(cluster.id, Stop(2.0), expected_state=ClusterState.PENDING) is None
    assert store.get(cluster.id).state is ClusterState.STARTING
    stale = store.transition(
        cluster.id,
        SetKeepAlive(2.0, True),
        expected_state=ClusterState.STARTING,
        expected_version=cluster.version,
    )
    assert stale is None
    ready = store.transition(
        cluster.id,
        Ready(3.0, "tls://127.0.0.1:40001", "/dask/1/status"),
        expected_state=ClusterState.STARTING,
        expected_version=launched.version,
    )
    assert ready is not None and store.get(cluster.id).scheduler_address == "tls://127.0.0.1:40001"
    with pytest.raises(IllegalTransition):
        store.transition(cluster.id, Launch(4.0, SCHEDULER), expected_state=ClusterState.RUNNING)
    with pytest.raises(ClusterNotFound):
        store.transition(999, Stop(1.0), expected_state=ClusterState.PENDING)


def test_of_two_racing_writers_exactly_one_wins(store):
    cluster = store.create(make_spec())
    barrier = threading.Barrier(8)

    def stop(i: int) -> bool:
        barrier.wait()
        won = store.transition(
            cluster.id, Stop(float(i), reason=f"writer {i}"), expected_state=ClusterState.PENDING
        )
        return won is not None

    with ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(stop, range(8)))
    assert wins.count(True) == 1
    assert store.get(cluster.id).version == 1


def test_worker_numbers_grow_and_are_never_reused(store):
    cluster = store.create(make_spec())
    first = store.add_workers(cluster.id, 3)
    assert [w.number for w in first] == [1, 2, 3]
    assert all(w.state is WorkerState.PENDING for w in first)
    store.transition_worker(cluster.id, 3, Retire(1.0), expected_state=WorkerState.PENDING)
    assert [w.number for w in store.add_workers(cluster.id, 2)] == [4, 5]
    assert [w.number for w in store.workers(cluster.id, states={WorkerState.STOPPED})] == [3]
    assert store.add_workers(cluster.id, 0) == []
    with pytest.raises(ClusterNotFound):
        store.add_workers(999, 1)


def test_workers_added_concurrently_get_distinct_numbers(store):
    cluster = store.create(make_spec())
    barrier = threading.Barrier(4)

    def add(_: int) -> list[int]:
        barrier.wait()
        return [w.number for w in store.add_workers(cluster.id, 5)]

    with ThreadPoolExecutor(4) as pool:
        numbers = [n for batch in pool.map(add, range(4)) for n in batch]
    assert sorted(numbers) == list(range(1, 21))


def test_a_cluster_that_is_stopping_takes_no_workers(store):
    cluster = store.create(make_spec())
    store.transition(cluster.id, Stop(1.0), expected_state=ClusterState.PENDING)
    with pytest.raises(ClusterEnded, match="stopping"):
        store.add_workers(cluster.id, 1)


def test_worker_transitions_are_stored_and_compare_and_set(store):
    cluster = store.create(make_spec())
    (worker,) = store.add_workers(cluster.id, 1)
    admitted = store.transition_worker(
        cluster.id, 1, AdmitWorker(1.0, PLACED), expected_state=WorkerState.PENDING
    )
    assert admitted is not None and store.get_worker(cluster.id, 1) == admitted
    assert admitted.placement == PLACED
    lost = store.transition_worker(
        cluster.id, 1, AdmitWorker(1.0, PLACED), expected_state=WorkerState.PENDING
    )
    assert lost is None
    stale = store.transition_worker(
        cluster.id,
        1,
        Joined(2.0),
        expected_state=WorkerState.ADMITTED,
        expected_version=worker.version,
    )
    assert stale is None
    with pytest.raises(ClusterNotFound):
        store.get_worker(cluster.id, 2)
    with pytest.raises(ClusterNotFound):
        store.transition_worker(cluster.id, 2, Joined(1.0), expected_state=WorkerState.ADMITTED)


def test_live_allocations_are_the_held_schedulers_and_workers(store):
    cluster = store.create(make_spec())
    other = store.create(make_spec(owner="bob"))
    store.add_workers(cluster.id, 3)
    store.add_workers(other.id, 1)
    assert store.live_allocation_ids() == set()  # pending: nothing placed yet
    store.transition(cluster.id, Launch(1.0, SCHEDULER), expected_state=ClusterState.PENDING)
    for number in (1, 2):
        store.transition_worker(
            cluster.id, number, AdmitWorker(1.0, PLACED), expected_state=WorkerState.PENDING
        )
    store.transition_worker(cluster.id, 2, Retire(2.0), expected_state=WorkerState.ADMITTED)
    expected = {
        f"alice/dask-{cluster.id}-scheduler",
        f"alice/dask-{cluster.id}-w1",
        f"alice/dask-{cluster.id}-w2",  # retiring: it still runs and holds its share
    }
    assert store.live_allocation_ids() == expected
    store.transition_worker(cluster.id, 2, Exited(3.0), expected_state=WorkerState.RETIRING)
    assert store.live_allocation_ids() == expected - {f"alice/dask-{cluster.id}-w2"}


def test_handles_are_kept_per_component(store):
    cluster = store.create(make_spec())
    assert store.handle(cluster.id, "scheduler") is None
    store.set_handle(cluster.id, "scheduler", {"pid": 10, "start": 1.5})
    store.set_handle(cluster.id, "w1", {"pod": "etl-w1"})
    store.set_handle(cluster.id, "scheduler", {"pid": 11, "start": 2.5})
    assert store.handle(cluster.id, "scheduler") == {"pid": 11, "start": 2.5}
    assert store.handle(cluster.id, "w1") == {"pod": "etl-w1"}


def test_a_store_reopened_finds_everything_and_a_newer_schema_is_refused(tmp_path):
    url = sqlite_url(tmp_path)
    first = ClusterStore(url)
    cluster = first.create(make_spec())
    first.close()
    second = ClusterStore(url)
    assert second.get(cluster.id) == cluster
    second.close()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO gpulab_dask_schema VALUES (:v)"), {"v": SCHEMA_VERSION + 1}
        )
    engine.dispose()
    with pytest.raises(SchemaTooNew, match="newer gpulab"):
        ClusterStore(url)
