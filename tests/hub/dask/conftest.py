"""Fixtures of the Dask cluster core's tests: a store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulab.hub.dask import ClusterSpec, ClusterStore


def make_spec(**changes: object) -> ClusterSpec:
    """A valid spec of alice's ("etl", 1/4-GPU workers, two of them), with ``changes``."""
    values: dict[str, object] = {
        "owner": "alice",
        "name": "etl",
        "profile": "gpu-quarter",
        "groups": frozenset({"students"}),
        "n_workers": 2,
    }
    values.update(changes)
    return ClusterSpec(**values)  # type: ignore[arg-type]


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database's URL: a SQLite file, then a database on the session's PostgreSQL
    (the harness fixture `postgres`, which marks those tests e2e)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/dask.sqlite"
    return str(request.getfixturevalue(request.param).new_database())


@pytest.fixture
def store(store_url: str) -> Iterator[ClusterStore]:
    """A ClusterStore on `store_url` whose clock moves one second per reading."""
    ticks = itertools.count()
    s = ClusterStore(store_url, clock=lambda: 1000.0 + next(ticks))
    yield s
    s.close()
