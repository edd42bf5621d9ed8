"""The durable store of jobs, runs, attempts, outputs and log offsets (SQLAlchemy Core).

SQLite on the embedded default (a file in the hub's state directory, WAL journal, full sync) and
PostgreSQL for cluster installs, where several hub workers or a restarted hub share one database.

Every method is synchronous and one transaction. Async callers (the hub's handlers, the job
service) call them through ``await asyncio.to_thread(store.method, ...)``: a database round trip
must never block the event loop, and the engine's connection pool is safe across threads.

State changes are compare-and-set: ``transition(run_id, event, expected_state=...)`` writes only
if the run is still in the state (and version) the caller decided on, and returns None otherwise.
So two hub workers that both saw a run queued cannot both admit it, and a hub that restarts in the
middle of a change cannot apply it twice: one writer wins, the other learns it lost and gives
its GPU share back.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from .database import create_schema, dumps, make_engine, upsert, writing
from .model import (
    Attempt,
    Event,
    JobSpec,
    PlacementSummary,
    Run,
    RunState,
    check_relative_path,
    transition,
)

#: The schema this code writes. A database of a newer one is refused rather than misread.
SCHEMA_VERSION = 2
#: What brings a database of the version before each key to it (run in order, once).
MIGRATIONS: dict[int, tuple[str, ...]] = {
    # attempts say whether they failed before the job's own code started (the platform's failure)
    2: (
        "ALTER TABLE gpulab_job_attempts ADD COLUMN platform_failure BOOLEAN NOT NULL DEFAULT false",
    ),
}
#: The SQLite file's name in the hub's state directory.
SQLITE_FILE = "gpulab-jobs.sqlite"

metadata = sa.MetaData()

# Plain Text for JSON and Float seconds since the epoch for times: the same on SQLite and
# PostgreSQL, and what the allocator's own store uses.
schema_version = sa.Table(
    "gpulab_jobs_schema",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
)

jobs = sa.Table(
    "gpulab_jobs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("owner", sa.Text, nullable=False, index=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    # ids are never reused after a delete: a run's URL must not come to mean someone else's run
    sqlite_autoincrement=True,
)

runs = sa.Table(
    "gpulab_job_runs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.Integer, sa.ForeignKey("gpulab_jobs.id"), nullable=False, index=True),
    sa.Column("owner", sa.Text, nullable=False, index=True),
    sa.Column("state", sa.Text, nullable=False, index=True),
    sa.Column("submitted_at", sa.Float, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("max_retries", sa.Integer, nullable=False),
    sa.Column("timeout_seconds", sa.Integer, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sqlite_autoincrement=True,
)

attempts = sa.Table(
    "gpulab_job_attempts",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("gpulab_job_runs.id"), primary_key=True),
    sa.Column("number", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("admitted_at", sa.Float, nullable=False),
    sa.Column("placement", sa.Text, nullable=False),
    sa.Column("started_at", sa.Float, nullable=True),
    sa.Column("ended_at", sa.Float, nullable=True),
    sa.Column("outcome", sa.Text, nullable=True),
    sa.Column("exit_code", sa.Integer, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("platform_failure", sa.Boolean, nullable=False, server_default=sa.false()),
)

outputs = sa.Table(
    "gpulab_job_outputs",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("gpulab_job_runs.id"), primary_key=True),
    sa.Column("path", sa.Text, primary_key=True),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("recorded_at", sa.Float, nullable=False),
)

# What an executor needs to find an attempt's process or Kubernetes Job again after a hub restart
# (the local runner's pid + start time + paths; a Job's name): its own JSON, opaque to the store.
handles = sa.Table(
    "gpulab_job_handles",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("gpulab_job_runs.id"), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("handle", sa.Text, nullable=False),
)

log_offsets = sa.Table(
    "gpulab_job_log_offsets",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("gpulab_job_runs.id"), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("stream", sa.Text, primary_key=True),
    sa.Column("offset", sa.BigInteger, nullable=False),
)


class JobNotFound(KeyError):
    """No job or run with that id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


@dataclass(frozen=True)
class Job:
    """A stored job definition."""

    id: int
    spec: JobSpec
    created_at: float


@dataclass(frozen=True)
class Output:
    """A file a run wrote, relative to the run's output directory."""

    path: str
    size_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", check_relative_path("path", self.path))
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int):
            raise ValueError(f"Output {self.path!r}: size_bytes must be an int")
        if self.size_bytes < 0:
            raise ValueError(f"Output {self.path!r}: size_bytes must be >= 0")


def sqlite_url(state_dir: str | Path) -> str:
    """The embedded default's database: ``gpulab-jobs.sqlite`` in the hub's state directory."""
    return f"sqlite:///{Path(state_dir).resolve() / SQLITE_FILE}"


class JobStore:
    """Jobs, runs, attempts, outputs and log offsets in one database (see the module doc).

    Synchronous; call it from async code with ``asyncio.to_thread``. Every method is one
    transaction. ``clock`` gives the time of submissions and outputs (events carry their own).
    """

    def __init__(self, url: str | URL, *, clock: Callable[[], float] = time.time) -> None:
        self.engine = make_engine(url)
        self.clock = clock
        try:
            self._create_schema()
        except BaseException:
            self.engine.dispose()
            raise

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Connection]:
        """A transaction that will write (on SQLite: holds the write lock from its start)."""
        with writing(self.engine) as conn:
            yield conn

    # -- schema --------------------------------------------------------------------------------

    def _create_schema(self) -> None:
        create_schema(
            self.engine,
            metadata,
            schema_version,
            SCHEMA_VERSION,
            lock_id=4242160001,
            what="jobs",
            migrations=MIGRATIONS,
        )

    @property
    def schema_version(self) -> int:
        """The schema version recorded in the database."""
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar_one())

    # -- jobs ----------------------------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> Job:
        """Store a job definition (no run yet)."""
        with self._writing() as conn:
            return self._add_job(conn, spec)

    def _add_job(self, conn: Connection, spec: JobSpec) -> Job:
        now = self.clock()
        job_id = conn.execute(
            jobs.insert()
            .values(owner=spec.owner, name=spec.name, spec=dumps(spec.to_dict()), created_at=now)
            .returning(jobs.c.id)
        ).scalar_one()
        return Job(int(job_id), spec, now)

    def get_job(self, job_id: int) -> Job:
        """The job, or ``JobNotFound``."""
        with self.engine.connect() as conn:
            row = conn.execute(jobs.select().where(jobs.c.id == job_id)).first()
        if row is None:
            raise JobNotFound(f"no job {job_id}")
        return _job(row)

    def list_jobs(self, owner: str | None = None) -> list[Job]:
        """Every job (of ``owner``), oldest first."""
        query = jobs.select().order_by(jobs.c.id)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        with self.engine.connect() as conn:
            return [_job(row) for row in conn.execute(query)]

    # -- runs ----------------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Run:
        """Store ``spec`` as a new job and queue its first run, in one transaction."""
        with self._writing() as conn:
            job = self._add_job(conn, spec)
            return self._add_run(conn, job)

    def submit_run(self, job_id: int) -> Run:
        """Queue another run of a stored job (a rerun), under the job's spec."""
        with self._writing() as conn:
            row = conn.execute(jobs.select().where(jobs.c.id == job_id)).first()
            if row is None:
                raise JobNotFound(f"no job {job_id}")
            return self._add_run(conn, _job(row))

    def _add_run(self, conn: Connection, job: Job) -> Run:
        now = self.clock()
        draft = Run.submitted(0, job.id, job.spec, now)
        values = _run_values(draft)
        del values["id"]
        run_id = conn.execute(runs.insert().values(**values).returning(runs.c.id)).scalar_one()
        return Run.submitted(int(run_id), job.id, job.spec, now)

    def get_run(self, run_id: int) -> Run:
        """The run with its attempts, or ``JobNotFound``."""
        with self.engine.connect() as conn:
            run = self._get_run(conn, run_id)
        if run is None:
            raise JobNotFound(f"no run {run_id}")
        return run

    def _get_run(self, conn: Connection, run_id: int) -> Run | None:
        row = conn.execute(runs.select().where(runs.c.id == run_id)).first()
        if row is None:
            return None
        rows = conn.execute(
            attempts.select().where(attempts.c.run_id == run_id).order_by(attempts.c.number)
        )
        return _run(row, tuple(_attempt(a) for a in rows))

    def list_runs(
        self,
        *,
        owner: str | None = None,
        job_id: int | None = None,
        states: Collection[RunState] | None = None,
    ) -> list[Run]:
        """Runs with their attempts, oldest first; filtered by owner, job and states when given
        (``states=HOLDING_STATES`` after a restart: the runs whose shares must be accounted for;
        ``states={RunState.QUEUED}`` for ``queue_order``)."""
        query = runs.select().order_by(runs.c.id)
        if owner is not None:
            query = query.where(runs.c.owner == owner)
        if job_id is not None:
            query = query.where(runs.c.job_id == job_id)
        if states is not None:
            query = query.where(runs.c.state.in_([s.value for s in states]))
        with self.engine.connect() as conn:
            run_rows = list(conn.execute(query))
            by_run: dict[int, list[Attempt]] = {row.id: [] for row in run_rows}
            if by_run:
                for a in conn.execute(
                    attempts.select()
                    .where(attempts.c.run_id.in_(list(by_run)))
                    .order_by(attempts.c.run_id, attempts.c.number)
                ):
                    by_run[a.run_id].append(_attempt(a))
        return [_run(row, tuple(by_run[row.id])) for row in run_rows]

    def transition(
        self,
        run_id: int,
        event: Event,
        *,
        expected_state: RunState,
        expected_version: int | None = None,
    ) -> Run | None:
        """Apply ``event`` to the run if it is still in ``expected_state`` (and, when given, at
        ``expected_version``); returns the changed run, or None when another writer changed it
        first (the caller lost the race and must undo what it prepared, e.g. release a share).

        Raises ``JobNotFound`` for an unknown run and ``IllegalTransition`` when the run is in
        the expected state but the event is not allowed from it (a caller's bug, not a race).
        """
        with self._writing() as conn:
            current = self._get_run(conn, run_id)
            if current is None:
                raise JobNotFound(f"no run {run_id}")
            if current.state is not expected_state or (
                expected_version is not None and current.version != expected_version
            ):
                return None
            changed = transition(current, event)
            # The compare-and-set itself: the row is written only if nobody changed it since the
            # read above. PostgreSQL re-checks the WHERE after a concurrent writer commits, and
            # SQLite lets one writer at a time in, so exactly one of two racers updates a row.
            result = conn.execute(
                runs.update()
                .where(
                    runs.c.id == run_id,
                    runs.c.state == current.state.value,
                    runs.c.version == current.version,
                )
                .values(
                    state=changed.state.value,
                    reason=changed.reason,
                    updated_at=changed.updated_at,
                    version=changed.version,
                )
            )
            if result.rowcount != 1:
                return None
            self._write_attempts(conn, current, changed)
            return changed

    def _write_attempts(self, conn: Connection, before: Run, after: Run) -> None:
        # a transition appends an attempt or changes the latest one; write what differs
        for attempt in after.attempts:
            index = attempt.number - 1
            if index < len(before.attempts):
                if before.attempts[index] == attempt:
                    continue
                conn.execute(
                    attempts.update()
                    .where(attempts.c.run_id == after.id, attempts.c.number == attempt.number)
                    .values(**_attempt_values(after.id, attempt))
                )
            else:
                conn.execute(attempts.insert().values(**_attempt_values(after.id, attempt)))

    # -- outputs and logs ----------------------------------------------------------------------

    def add_outputs(self, run_id: int, files: Iterable[Output]) -> None:
        """Record files a run wrote; a path recorded again gets its new size (idempotent, so an
        executor may report the whole directory after every attempt)."""
        now = self.clock()
        with self._writing() as conn:
            self._require_run(conn, run_id)
            for out in files:
                insert = upsert(conn, outputs).values(
                    run_id=run_id, path=out.path, size_bytes=out.size_bytes, recorded_at=now
                )
                conn.execute(
                    insert.on_conflict_do_update(
                        index_elements=[outputs.c.run_id, outputs.c.path],
                        set_={"size_bytes": insert.excluded.size_bytes, "recorded_at": now},
                    )
                )

    def outputs(self, run_id: int) -> list[Output]:
        """The files recorded for a run, by path."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(outputs.c.path, outputs.c.size_bytes)
                .where(outputs.c.run_id == run_id)
                .order_by(outputs.c.path)
            )
            return [Output(row.path, int(row.size_bytes)) for row in rows]

    def set_log_offset(self, run_id: int, attempt: int, stream: str, offset: int) -> int:
        """Record that ``offset`` bytes of an attempt's ``stream`` log ("stdout", "stderr",
        "progress") were delivered; returns the stored offset. Offsets only grow: a writer
        that reports an older offset after a newer one (two workers, a retried call) changes
        nothing, so a restarted hub resumes where the log really was."""
        if not stream:
            raise ValueError("a log stream needs a name (e.g. 'stdout')")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"a log offset is an int >= 0, got {offset!r}")
        key = (
            (log_offsets.c.run_id == run_id)
            & (log_offsets.c.attempt == attempt)
            & (log_offsets.c.stream == stream)
        )
        with self._writing() as conn:
            self._require_run(conn, run_id)
            insert = upsert(conn, log_offsets).values(
                run_id=run_id, attempt=attempt, stream=stream, offset=offset
            )
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=[
                        log_offsets.c.run_id,
                        log_offsets.c.attempt,
                        log_offsets.c.stream,
                    ],
                    set_={"offset": insert.excluded.offset},
                    where=log_offsets.c.offset < insert.excluded.offset,
                )
            )
            return int(conn.execute(sa.select(log_offsets.c.offset).where(key)).scalar_one())

    def log_offsets(self, run_id: int) -> dict[tuple[int, str], int]:
        """(attempt, stream) -> delivered bytes, for one run."""
        with self.engine.connect() as conn:
            rows = conn.execute(log_offsets.select().where(log_offsets.c.run_id == run_id))
            return {(int(r.attempt), r.stream): int(r.offset) for r in rows}

    def set_handle(self, run_id: int, attempt: int, handle: Mapping[str, Any]) -> None:
        """Record the executor's handle of an attempt (replacing an earlier one)."""
        with self._writing() as conn:
            self._require_run(conn, run_id)
            insert = upsert(conn, handles).values(
                run_id=run_id, attempt=attempt, handle=dumps(dict(handle))
            )
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=[handles.c.run_id, handles.c.attempt],
                    set_={"handle": insert.excluded.handle},
                )
            )

    def handle(self, run_id: int, attempt: int) -> dict[str, Any] | None:
        """The executor's handle of an attempt, or None when none was recorded (the hub
        stopped between admitting the attempt and starting it)."""
        with self.engine.connect() as conn:
            value = conn.execute(
                sa.select(handles.c.handle).where(
                    (handles.c.run_id == run_id) & (handles.c.attempt == attempt)
                )
            ).scalar_one_or_none()
        return None if value is None else dict(json.loads(value))

    def _require_run(self, conn: Connection, run_id: int) -> None:
        if conn.execute(sa.select(runs.c.id).where(runs.c.id == run_id)).first() is None:
            raise JobNotFound(f"no run {run_id}")


# -- rows <-> values ----------------------------------------------------------------------------


def _job(row: Any) -> Job:
    return Job(int(row.id), JobSpec.from_dict(json.loads(row.spec)), float(row.created_at))


def _run_values(run: Run) -> dict[str, Any]:
    return {
        "id": run.id,
        "job_id": run.job_id,
        "owner": run.owner,
        "state": run.state.value,
        "submitted_at": run.submitted_at,
        "priority": run.priority,
        "max_retries": run.max_retries,
        "timeout_seconds": run.timeout_seconds,
        "reason": run.reason,
        "updated_at": run.updated_at,
        "version": run.version,
    }


def _run(row: Any, run_attempts: tuple[Attempt, ...]) -> Run:
    return Run(
        id=int(row.id),
        job_id=int(row.job_id),
        owner=row.owner,
        state=RunState(row.state),
        submitted_at=float(row.submitted_at),
        priority=int(row.priority),
        max_retries=int(row.max_retries),
        timeout_seconds=None if row.timeout_seconds is None else int(row.timeout_seconds),
        attempts=run_attempts,
        reason=row.reason,
        updated_at=float(row.updated_at),
        version=int(row.version),
    )


def _attempt_values(run_id: int, attempt: Attempt) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "number": attempt.number,
        "admitted_at": attempt.admitted_at,
        "placement": dumps(attempt.placement.to_dict()),
        "started_at": attempt.started_at,
        "ended_at": attempt.ended_at,
        "outcome": None if attempt.outcome is None else attempt.outcome.value,
        "exit_code": attempt.exit_code,
        "reason": attempt.reason,
        "platform_failure": attempt.platform_failure,
    }


def _attempt(row: Any) -> Attempt:
    return Attempt(
        number=int(row.number),
        admitted_at=float(row.admitted_at),
        placement=PlacementSummary.from_dict(json.loads(row.placement)),
        started_at=_float_or_none(row.started_at),
        ended_at=_float_or_none(row.ended_at),
        outcome=None if row.outcome is None else RunState(row.outcome),
        exit_code=None if row.exit_code is None else int(row.exit_code),
        reason=row.reason,
        platform_failure=bool(row.platform_failure),
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
