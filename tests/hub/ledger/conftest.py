"""Fixtures of the ledger tests: a store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulab.hub.ledger.store import LedgerStore


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database's URL: a SQLite file, then a database on the session's PostgreSQL
    (the harness fixture `postgres`, which marks those tests e2e)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ledger.sqlite"
    return str(request.getfixturevalue(request.param).new_database())


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[LedgerStore]:
    store = LedgerStore(ledger_url)
    yield store
    store.close()
