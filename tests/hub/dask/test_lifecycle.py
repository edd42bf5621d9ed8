"""When clusters end: idle timeouts, their server's stop, keep-alive, and the stop schedule."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.dask import (
    SHUTDOWN_LIMIT_SECONDS,
    Activity,
    Cluster,
    ClusterState,
    clusters_to_stop_with_server,
    idle_expired,
    idle_stop_reason,
    idle_timeout,
    next_idle_since,
    server_stop_reason,
    stop_schedule,
)

from .conftest import make_spec


def running(**spec_changes: object) -> Cluster:
    cluster = Cluster.created(1, make_spec(**spec_changes), 0.0)
    return replace(cluster, state=ClusterState.RUNNING)


def test_a_cluster_is_idle_only_without_tasks_and_clients():
    assert next_idle_since(None, Activity(10.0, tasks=0, clients=0)) == 10.0
    assert next_idle_since(10.0, Activity(20.0, tasks=0, clients=0)) == 10.0  # still idle since
    assert next_idle_since(10.0, Activity(30.0, tasks=3, clients=0)) is None
    assert next_idle_since(10.0, Activity(30.0, tasks=0, clients=1)) is None


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=30))
def test_idle_since_is_the_start_of_the_current_idle_stretch(samples):
    since = None
    for t, (tasks, clients) in enumerate(samples):
        since = next_idle_since(since, Activity(float(t), tasks, clients))
    busy_times = [t for t, (tasks, clients) in enumerate(samples) if tasks or clients]
    last_busy = busy_times[-1] if busy_times else -1
    expected = None if last_busy == len(samples) - 1 else float(last_busy + 1)
    assert since == expected


def test_the_timeout_is_the_spec_s_or_the_hub_s_default_and_never_above_the_hub_s_cap():
    assert idle_timeout(running(), default_seconds=1800, max_seconds=7200) == 1800
    assert idle_timeout(running(idle_timeout_seconds=600), 1800, 7200) == 600
    assert idle_timeout(running(idle_timeout_seconds=86_400), 1800, 7200) == 7200


def test_only_a_running_cluster_idles_out_and_keep_alive_does_not_spare_it():
    kept = running(keep_alive=True)
    assert idle_expired(kept, idle_since=100.0, now=700.0, timeout_seconds=600)
    assert not idle_expired(kept, idle_since=100.0, now=699.0, timeout_seconds=600)
    assert not idle_expired(kept, idle_since=None, now=10_000.0, timeout_seconds=600)
    starting = replace(kept, state=ClusterState.STARTING)
    assert not idle_expired(starting, idle_since=0.0, now=10_000.0, timeout_seconds=600)
    assert "600 s" in idle_stop_reason(600)


def test_a_server_s_stop_stops_its_clusters_that_are_not_kept_alive():
    mine = running(server="gpu")
    kept = replace(running(server="gpu", name="kept"), keep_alive=True)
    other_server = running(server="", name="default")
    other_user = running(owner="bob", server="gpu")
    stopped = replace(running(server="gpu", name="old"), state=ClusterState.STOPPED)
    clusters = [mine, kept, other_server, other_user, stopped]
    assert clusters_to_stop_with_server(clusters, "alice", "gpu") == [mine]
    assert clusters_to_stop_with_server(clusters, "alice", "") == [other_server]
    assert clusters_to_stop_with_server(clusters, "bob", "gpu") == [other_user]
    assert "server 'gpu'" in server_stop_reason("gpu")
    assert "default server" in server_stop_reason("")


def test_keep_alive_chosen_later_spares_the_cluster_from_its_server_s_stop():
    cluster = replace(running(server="gpu"), keep_alive=True)
    assert clusters_to_stop_with_server([cluster], "alice", "gpu") == []


def test_nothing_of_a_cluster_is_due_to_run_past_the_shutdown_limit():
    schedule = stop_schedule(1000.0)
    assert schedule.began < schedule.kill_workers_at < schedule.kill_scheduler_at
    assert schedule.kill_scheduler_at < schedule.deadline == 1000.0 + SHUTDOWN_LIMIT_SECONDS
