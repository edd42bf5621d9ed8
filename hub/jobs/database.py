"""The database plumbing gpulab's stores share (jobs, Dask clusters, the ledger): an engine for
SQLite or PostgreSQL set up alike, a writing transaction that takes SQLite's write lock at once,
the schema's creation and migration under an advisory lock, upserts and JSON as stored."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import StaticPool


class SchemaTooNew(RuntimeError):
    """The database was written by a newer gpulab; this one would misread it."""


def make_engine(url: str | URL) -> Engine:
    """An engine for ``url``: SQLite (a file, or ``sqlite://`` in memory) or PostgreSQL.

    A bare ``postgresql://`` URL means psycopg 3 (gpulab's ``postgres`` extra), not SQLAlchemy's
    default psycopg2, which gpulab does not install.
    """
    parsed = sa.make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() != "sqlite":
        return sa.create_engine(parsed, pool_pre_ping=True)
    if parsed.database in (None, "", ":memory:"):
        # one connection for every thread, or each thread of asyncio.to_thread would get an
        # empty database of its own (for tests and throw-away hubs: the threads then share one
        # connection, so concurrent calls are not isolated from each other)
        engine = sa.create_engine(
            parsed, poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
    else:
        engine = sa.create_engine(parsed, connect_args={"timeout": 30})
    sa.event.listen(engine, "connect", _sqlite_connect)
    sa.event.listen(engine, "begin", _sqlite_begin)
    return engine


#: execution option of the connections that write (``JobStore._writing``)
_WRITES = "gpulab_jobs_writes"


@contextlib.contextmanager
def writing(engine: Engine) -> Iterator[Connection]:
    """A transaction on ``engine`` that will write; on SQLite it holds the write lock from its
    start (see ``_sqlite_begin``). For the stores that share this engine setup (the Dask
    clusters' store); ``JobStore`` uses it too."""
    with engine.connect() as conn:
        conn.execution_options(**{_WRITES: True})
        with conn.begin():
            yield conn


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # transactions are begun by _sqlite_begin, not by the driver behind SQLAlchemy's back
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # WAL: the hub's readers (lists, the jobs panel) never wait for its writer; full sync: a run
    # the hub said it admitted is admitted after a power cut too
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # A writer takes SQLite's write lock when it begins, before it reads. Begun deferred, it
    # would read, then find at its first write that another process wrote since its snapshot,
    # and fail with "database is locked" at once (no busy wait helps a stale snapshot), where
    # the compare-and-set must instead wait its turn and then see the other's write.
    conn.exec_driver_sql(
        "BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITES) else "BEGIN"
    )


def create_schema(
    engine: Engine,
    tables: sa.MetaData,
    version_table: sa.Table,
    version: int,
    *,
    lock_id: int,
    what: str,
    migrations: Mapping[int, Sequence[str]] | None = None,
) -> None:
    """Create the tables of ``tables`` if missing and record ``version`` in ``version_table``;
    ``SchemaTooNew`` when a newer gpulab wrote a higher one. An older database is brought to
    ``version`` by ``migrations`` (version -> the SQL statements that reach it from the one
    before), in the same transaction. Safe to run from several processes
    at once: on PostgreSQL two hub workers starting together would both find a table missing
    and both create it, so the advisory lock ``lock_id`` (one per store) makes the second wait
    and then find it. ``what`` names the database in the error ("jobs", "Dask clusters")."""
    with writing(engine) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text(f"SELECT pg_advisory_xact_lock({int(lock_id)})"))
        for table in tables.sorted_tables:
            conn.execute(sa.schema.CreateTable(table, if_not_exists=True))
            for index in table.indexes:
                conn.execute(sa.schema.CreateIndex(index, if_not_exists=True))
        stored = conn.execute(sa.select(sa.func.max(version_table.c.version))).scalar()
        if stored is None:
            conn.execute(version_table.insert().values(version=version))
        elif stored < version:
            for step in range(stored + 1, version + 1):
                for statement in (migrations or {}).get(step, ()):
                    conn.exec_driver_sql(statement)
                conn.execute(version_table.insert().values(version=step))
        elif stored > version:
            raise SchemaTooNew(
                f"the {what} database {engine.url.render_as_string(hide_password=True)} "
                f"has schema version {stored}, written by a newer gpulab; this one "
                f"understands up to {version}. Upgrade gpulab or point it at another database."
            )


def upsert(conn: Connection, table: sa.Table) -> Any:
    """An INSERT with ``on_conflict_do_update`` (an upsert, one statement on both databases)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def dumps(value: object) -> str:
    """JSON as the stores keep it (sorted keys, no NaN)."""
    return json.dumps(value, sort_keys=True, allow_nan=False)
