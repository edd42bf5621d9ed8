"""Fixtures of the ledger tests: a store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpulab.hub.ledger.store import LedgerStore


@pytest.fixture
def ledger_url(database_url: str) -> str:
    """An empty database: SQLite, then PostgreSQL (the harness's `database_url`)."""
    return database_url


@pytest.fixture
def ledger(ledger_url: str) -> Iterator[LedgerStore]:
    store = LedgerStore(ledger_url)
    yield store
    store.close()
