"""Fixtures of the jobs tests: a store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from gpulab.hub.jobs import JobStore


@pytest.fixture
def store_url(database_url: str) -> str:
    """An empty database: SQLite, then PostgreSQL (the harness's `database_url`)."""
    return database_url


class TickingClock:
    """A clock that moves one second per reading, so every submission has its own time."""

    def __init__(self, start: float = 1000.0) -> None:
        self._ticks = itertools.count()
        self.start = start

    def __call__(self) -> float:
        return self.start + next(self._ticks)


@pytest.fixture
def store(store_url: str) -> Iterator[JobStore]:
    """A JobStore on `store_url` with a ticking clock; closed after the test."""
    s = JobStore(store_url, clock=TickingClock())
    yield s
    s.close()
