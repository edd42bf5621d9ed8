"""The ledger's store on SQLite and a real PostgreSQL server: intervals, usage, counters."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from gpulab.hub.jobs import SchemaTooNew
from gpulab.hub.ledger import PREEMPTED, RELEASED, UsageSample
from gpulab.hub.ledger.store import LedgerStore, schema_version

from .test_model import holding


def test_sync_opens_closes_and_survives_a_reopen(ledger: LedgerStore, ledger_url: str):
    a, b = holding("alice/"), holding("bob/", device="gpu-1", milli=1000)
    ledger.sync([a, b], 100)
    ledger.sync([a], 160, reasons={"bob/": PREEMPTED})
    again = LedgerStore(ledger_url)  # a restarted hub
    try:
        (open_a,) = again.open_intervals()
        assert (open_a.holding, open_a.start, open_a.end) == (a, 100, None)
        closed = [i for i in again.intervals(0, 1000) if not i.open]
        assert [(i.holding.user, i.start, i.end, i.end_reason) for i in closed] == [
            ("bob", 100, 160, PREEMPTED)
        ]
        assert not again.sync([a], 200)  # nothing changed: nothing written
        again.sync([], 220)
        assert again.open_intervals() == []
        (a_closed,) = again.intervals(0, 1000, users={"alice"})
        assert (a_closed.end, a_closed.end_reason) == (220, RELEASED)
    finally:
        again.close()


def test_intervals_overlapping_a_window_only(ledger: LedgerStore):
    ledger.sync([holding("a/")], 100)
    ledger.sync([], 200)
    ledger.sync([holding("b/")], 300)
    assert [i.holding.user for i in ledger.intervals(150, 250)] == ["a"]
    assert [i.holding.user for i in ledger.intervals(200, 400)] == ["b"]
    assert ledger.intervals(0, 100) == []


def test_allocated_totals_count_open_intervals_up_to_now(ledger: LedgerStore):
    ledger.sync([holding("a/", milli=250)], 0)
    ledger.sync(
        [holding("a/", milli=250), holding("a/job-1", workload="job", device="g2", milli=1000)],
        3600,
    )
    totals = {(u, w): ms for u, _, w, ms in ledger.allocated_totals(7200)}
    assert totals == {("a", "server"): 250 * 7200, ("a", "job"): 1000 * 3600}


def test_usage_adds_up_per_user_server_device_and_hour(ledger: LedgerStore):
    ledger.add_usage([UsageSample("a", "", "g0", 3600, 10.0, 15.0)])
    ledger.add_usage(
        [UsageSample("a", "", "g0", 3600, 5.0, 15.0), UsageSample("b", "x", "g1", 7200, 1.0, 15.0)]
    )
    got = sorted(ledger.usage(3600, 7201), key=lambda s: s.user)
    assert [(s.user, s.hour, s.used_gpu_seconds, s.sampled_seconds) for s in got] == [
        ("a", 3600, 15.0, 30.0),
        ("b", 7200, 1.0, 15.0),
    ]
    assert [s.user for s in ledger.usage(7200, 10000, users={"b"})] == ["b"]


def test_a_ledger_of_a_newer_gpulab_is_refused(ledger: LedgerStore, ledger_url: str):
    with ledger.engine.begin() as conn:
        conn.execute(sa.insert(schema_version).values(version=99))
    with pytest.raises(SchemaTooNew, match="GPU-hour ledger"):
        LedgerStore(ledger_url)


def test_live_figures_are_replaced_per_slice_and_forgotten_with_their_server(ledger: LedgerStore):
    from gpulab.hub.ledger.store import LiveFigure

    first = LiveFigure("a", "", "g0", 100.0, 50.0, 1024.0, 20480.0, None, 5.0)
    ledger.put_live([first, LiveFigure("b", "x", "g1", 100.0, 1.0, 0.0, 0.0, 90.0, 5.0)])
    ledger.put_live([LiveFigure("a", "", "g0", 115.0, 2.0, 10.0, 20480.0, 115.0, 5.0)])
    got = {f.user: f for f in ledger.live_figures(newer_than=0)}
    assert (got["a"].t, got["a"].utilization_pct, got["a"].below_since) == (115.0, 2.0, 115.0)
    assert [f.user for f in ledger.live_figures(newer_than=100.0)] == ["a"]  # b's is older
    ledger.forget_live([("a", "")])
    assert [f.user for f in ledger.live_figures(newer_than=0)] == ["b"]
