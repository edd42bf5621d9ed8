"""The jobs store's contract, on SQLite and on a real PostgreSQL server alike."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from gpulab.hub.jobs import (
    SCHEMA_VERSION,
    Admit,
    Fail,
    IllegalTransition,
    JobNotFound,
    JobStore,
    Output,
    Retry,
    RunState,
    SchemaTooNew,
    Start,
    Succeed,
    make_engine,
    sqlite_url,
)
from tests.harness.jobs import PLACEMENT, make_spec


def test_a_submission_stores_the_job_and_queues_its_first_run(store):
    spec = make_spec(kind="notebook", path="nb/a.ipynb", parameters={"lr": 0.1, "tags": ["x"]})
    run = store.submit(spec)
    assert run.state is RunState.QUEUED
    assert store.get_run(run.id) == run
    job = store.get_job(run.job_id)
    assert job.spec == spec
    assert [j.id for j in store.list_jobs(owner="alice")] == [job.id]


def test_a_rerun_is_a_new_run_of_the_same_job_under_its_spec(store):
    first = store.submit(make_spec(priority=3, max_retries=2, timeout_seconds=60))
    again = store.submit_run(first.job_id)
    assert again.id != first.id
    assert (again.job_id, again.priority, again.max_retries, again.timeout_seconds) == (
        first.job_id,
        3,
        2,
        60,
    )
    assert again.submitted_at > first.submitted_at
    with pytest.raises(JobNotFound):
        store.submit_run(999)


def test_runs_are_listed_oldest_first_by_owner_job_and_state(store):
    a1 = store.submit(make_spec())
    b1 = store.submit(make_spec(owner="bob"))
    a2 = store.submit_run(a1.job_id)
    store.transition(a2.id, Admit(5.0, PLACEMENT), expected_state=RunState.QUEUED)
    assert [r.id for r in store.list_runs()] == [a1.id, b1.id, a2.id]
    assert [r.id for r in store.list_runs(owner="alice")] == [a1.id, a2.id]
    assert [r.id for r in store.list_runs(job_id=a1.job_id)] == [a1.id, a2.id]
    assert [r.id for r in store.list_runs(states={RunState.QUEUED})] == [a1.id, b1.id]
    (admitted,) = store.list_runs(states={RunState.ADMITTED, RunState.RUNNING})
    assert admitted.attempts[0].placement == PLACEMENT


def test_each_transition_is_stored_with_its_attempts(store):
    run = store.submit(make_spec(max_retries=1))
    steps = [
        (Admit(1.0, PLACEMENT), RunState.QUEUED),
        (Start(2.0), RunState.ADMITTED),
        (Fail(3.0, reason="exit code 1", exit_code=1), RunState.RUNNING),
        (Retry(4.0), RunState.FAILED),
        (Admit(5.0, PLACEMENT), RunState.QUEUED),
        (Start(6.0), RunState.ADMITTED),
        (Succeed(7.0), RunState.RUNNING),
    ]
    for event, expected in steps:
        changed = store.transition(run.id, event, expected_state=expected)
        assert changed is not None
        assert store.get_run(run.id) == changed
    final = store.get_run(run.id)
    assert final.state is RunState.SUCCEEDED
    assert final.version == len(steps)
    assert [(a.number, a.outcome, a.exit_code) for a in final.attempts] == [
        (1, RunState.FAILED, 1),
        (2, RunState.SUCCEEDED, 0),
    ]
    assert final.attempts[0].reason == "exit code 1"
    assert (final.attempts[1].started_at, final.attempts[1].ended_at) == (6.0, 7.0)


def test_a_lost_compare_and_set_returns_none_and_changes_nothing(store_url):
    worker_a = JobStore(store_url)
    worker_b = JobStore(store_url)
    try:
        run = worker_a.submit(make_spec())
        seen_by_b = worker_b.get_run(run.id)  # B decides from this copy ...
        won = worker_a.transition(run.id, Admit(1.0, PLACEMENT), expected_state=RunState.QUEUED)
        assert won is not None
        # ... and loses: the run is no longer queued
        lost = worker_b.transition(
            seen_by_b.id, Admit(1.5, PLACEMENT), expected_state=seen_by_b.state
        )
        assert lost is None
        assert worker_b.get_run(run.id) == won
        assert len(won.attempts) == 1
    finally:
        worker_a.close()
        worker_b.close()


def test_the_expected_version_refuses_a_run_that_came_back_to_the_same_state(store):
    run = store.submit(make_spec(max_retries=1))
    stale_version = run.version
    for event, state in [
        (Admit(1.0, PLACEMENT), RunState.QUEUED),
        (Fail(2.0), RunState.ADMITTED),
        (Retry(3.0), RunState.FAILED),
    ]:
        store.transition(run.id, event, expected_state=state)
    assert store.get_run(run.id).state is RunState.QUEUED  # queued again, three changes later
    assert (
        store.transition(
            run.id,
            Admit(4.0, PLACEMENT),
            expected_state=RunState.QUEUED,
            expected_version=stale_version,
        )
        is None
    )
    assert store.transition(
        run.id, Admit(4.0, PLACEMENT), expected_state=RunState.QUEUED, expected_version=3
    )


def test_two_hub_workers_admitting_at_once_admit_each_run_exactly_once(store_url):
    workers = [JobStore(store_url), JobStore(store_url)]
    try:
        run_ids = [workers[0].submit(make_spec()).id for _ in range(12)]
        start = threading.Barrier(len(workers))

        def admit_all(worker: JobStore) -> list[int]:
            start.wait()
            won = []
            for run_id in run_ids:
                changed = worker.transition(
                    run_id, Admit(1.0, PLACEMENT), expected_state=RunState.QUEUED
                )
                if changed is not None:
                    won.append(run_id)
            return won

        with ThreadPoolExecutor(len(workers)) as pool:
            wins = list(pool.map(admit_all, workers))
        assert sorted(wins[0] + wins[1]) == run_ids  # every run once, none twice
        for run in workers[1].list_runs():
            assert run.state is RunState.ADMITTED
            assert len(run.attempts) == 1
    finally:
        for worker in workers:
            worker.close()


def test_an_illegal_event_raises_and_writes_nothing(store):
    run = store.submit(make_spec())
    with pytest.raises(IllegalTransition):
        store.transition(run.id, Succeed(1.0), expected_state=RunState.QUEUED)
    assert store.get_run(run.id) == run


def test_unknown_ids_raise_not_found(store):
    with pytest.raises(JobNotFound):
        store.get_run(404)
    with pytest.raises(JobNotFound):
        store.get_job(404)
    with pytest.raises(JobNotFound):
        store.transition(404, Start(1.0), expected_state=RunState.ADMITTED)
    with pytest.raises(JobNotFound):
        store.add_outputs(404, [Output("a.txt", 1)])
    with pytest.raises(JobNotFound):
        store.set_log_offset(404, 1, "stdout", 10)


def test_outputs_are_recorded_once_per_path_with_the_latest_size(store):
    run = store.submit(make_spec())
    store.add_outputs(run.id, [Output("executed.ipynb", 100), Output("tb/events.1", 5)])
    store.add_outputs(run.id, [Output("./tb/events.1", 50), Output("model.pt", 7)])
    assert store.outputs(run.id) == [
        Output("executed.ipynb", 100),
        Output("model.pt", 7),
        Output("tb/events.1", 50),
    ]
    assert store.outputs(store.submit_run(run.job_id).id) == []


def test_an_output_outside_the_run_directory_is_refused():
    with pytest.raises(ValueError, match="'..'"):
        Output("../../etc/passwd", 1)


def test_log_offsets_only_grow(store):
    run = store.submit(make_spec())
    assert store.set_log_offset(run.id, 1, "stdout", 100) == 100
    assert store.set_log_offset(run.id, 1, "stdout", 40) == 100  # a late, older report
    assert store.set_log_offset(run.id, 1, "stdout", 250) == 250
    assert store.set_log_offset(run.id, 1, "stderr", 3) == 3
    assert store.set_log_offset(run.id, 2, "stdout", 0) == 0
    assert store.log_offsets(run.id) == {(1, "stdout"): 250, (1, "stderr"): 3, (2, "stdout"): 0}
    with pytest.raises(ValueError):
        store.set_log_offset(run.id, 1, "stdout", -1)


def test_an_attempts_executor_handle_is_kept_and_replaced(store):
    run = store.submit(make_spec())
    assert store.handle(run.id, 1) is None  # admitted, not started: nothing to find again
    store.set_handle(run.id, 1, {"pid": 42, "start_ticks": 7})
    store.set_handle(run.id, 2, {"job": "run-1-2"})
    assert store.handle(run.id, 1) == {"pid": 42, "start_ticks": 7}
    store.set_handle(run.id, 1, {"pid": 43, "start_ticks": 9})
    assert store.handle(run.id, 1) == {"pid": 43, "start_ticks": 9}
    assert store.handle(run.id, 2) == {"job": "run-1-2"}
    with pytest.raises(JobNotFound):
        store.set_handle(run.id + 1000, 1, {})


def test_everything_survives_a_hub_restart(store_url):
    before = JobStore(store_url)
    run = before.submit(make_spec(max_retries=1, environment={"SEED": "1"}))
    before.transition(run.id, Admit(1.0, PLACEMENT), expected_state=RunState.QUEUED)
    running = before.transition(run.id, Start(2.0), expected_state=RunState.ADMITTED)
    before.add_outputs(run.id, [Output("out.txt", 12)])
    before.set_log_offset(run.id, 1, "stdout", 4096)
    job = before.get_job(run.job_id)
    before.close()

    after = JobStore(store_url)  # the restarted hub
    try:
        assert after.get_run(run.id) == running
        assert after.get_job(run.job_id) == job
        assert after.list_runs(states={RunState.RUNNING}) == [running]
        assert after.outputs(run.id) == [Output("out.txt", 12)]
        assert after.log_offsets(run.id) == {(1, "stdout"): 4096}
        done = after.transition(run.id, Succeed(3.0), expected_state=RunState.RUNNING)
        assert done is not None and done.state is RunState.SUCCEEDED
        # ids go on from where they were: a new run never takes an old one's id
        assert after.submit(make_spec()).id > run.id
    finally:
        after.close()


def test_opening_the_store_again_keeps_one_schema_version(store_url):
    first = JobStore(store_url)
    second = JobStore(store_url)
    try:
        assert first.schema_version == second.schema_version == SCHEMA_VERSION
        with second.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT version FROM gpulab_jobs_schema")).all()
        assert rows == [(SCHEMA_VERSION,)]
    finally:
        first.close()
        second.close()


def test_a_database_of_schema_1_gains_the_platform_failure_of_its_attempts(store_url):
    store = JobStore(store_url)
    run = store.submit(make_spec())
    store.transition(run.id, Admit(1.0, PLACEMENT), expected_state=RunState.QUEUED)
    store.close()
    engine = make_engine(store_url)
    with engine.begin() as conn:  # the database as gpulab wrote it before the column
        conn.execute(sa.text("ALTER TABLE gpulab_job_attempts DROP COLUMN platform_failure"))
        conn.execute(sa.text("DELETE FROM gpulab_jobs_schema"))
        conn.execute(sa.text("INSERT INTO gpulab_jobs_schema (version) VALUES (1)"))
    engine.dispose()
    again = JobStore(store_url)
    try:
        assert again.schema_version == SCHEMA_VERSION
        admitted = again.get_run(run.id)
        assert admitted.attempt is not None and not admitted.attempt.platform_failure
        again.transition(run.id, Start(2.0), expected_state=RunState.ADMITTED)
        failed = again.transition(
            run.id,
            Fail(3.0, reason="kernel did not start", platform_failure=True),
            expected_state=RunState.RUNNING,
        )
        assert failed is not None
        stored = again.get_run(run.id).attempt
        assert (
            stored is not None
            and stored.platform_failure
            and stored.reason == "kernel did not start"
        )
    finally:
        again.close()


def test_a_database_of_a_newer_schema_is_refused(store_url):
    JobStore(store_url).close()
    engine = make_engine(store_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE gpulab_jobs_schema SET version = :v"), {"v": SCHEMA_VERSION + 1}
        )
    engine.dispose()
    with pytest.raises(SchemaTooNew, match="newer gpulab"):
        JobStore(store_url)


async def test_async_code_calls_the_store_through_to_thread(store):
    run = await asyncio.to_thread(store.submit, make_spec())
    changed = await asyncio.to_thread(
        store.transition, run.id, Admit(1.0, PLACEMENT), expected_state=RunState.QUEUED
    )
    assert changed == await asyncio.to_thread(store.get_run, run.id)


# -- SQLite and URL specifics (no server needed) ---------------------------------------------------


def test_the_embedded_default_keeps_its_database_in_the_state_dir_in_wal_mode(tmp_path):
    url = sqlite_url(tmp_path)
    assert url == f"sqlite:///{tmp_path.resolve()}/gpulab-jobs.sqlite"
    store = JobStore(url)
    try:
        store.submit(make_spec())
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        store.close()
    assert (tmp_path / "gpulab-jobs.sqlite").exists()


def test_an_in_memory_store_is_one_database_for_every_thread():
    store = JobStore("sqlite://")
    try:
        run = store.submit(make_spec())
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(store.get_run, run.id).result() == run
    finally:
        store.close()


def test_a_bare_postgresql_url_means_psycopg_3():
    engine = make_engine("postgresql://gpulab@db.example/jobs")
    assert engine.url.drivername == "postgresql+psycopg"
    engine.dispose()
