"""Fixtures of the Dask cluster core's tests: a store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

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


@pytest.fixture
def store_url(database_url: str) -> str:
    """An empty database: SQLite, then PostgreSQL (the harness's `database_url`)."""
    return database_url


@pytest.fixture
def store(store_url: str) -> Iterator[ClusterStore]:
    """A ClusterStore on `store_url` whose clock moves one second per reading."""
    ticks = itertools.count()
    s = ClusterStore(store_url, clock=lambda: 1000.0 + next(ticks))
    yield s
    s.close()
