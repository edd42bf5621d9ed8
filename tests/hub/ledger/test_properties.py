"""Ledger exactness under any sequence of grants, releases, preemptions and hub restarts.

A real allocator (persisted, so a "restart" rebuilds it from its store as the hub does) feeds a
real ledger store through `LedgerFeed`, on a clock the test moves. Two properties:
- capacity: at no instant do a device's open intervals hold more than the device;
- reconciliation: each allocation's GPU-seconds in the ledger equal the allocator's own record
  (from its grant time to the change that removed it), exactly, at the ledger's 1 s resolution.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulab.hub.allocator import (
    GPU,
    Allocator,
    Inventory,
    NoCapacity,
    Node,
    QuotaExceeded,
    Request,
    SQLiteStore,
)
from gpulab.hub.ledger import PREEMPTED, RELEASED
from gpulab.hub.ledger.feed import LedgerFeed
from gpulab.hub.ledger.store import LedgerStore

INVENTORY = Inventory(
    [
        Node(
            "n1",
            cpu_milli=64_000,
            memory_mib=1 << 20,
            gpus=(GPU("g0", "A100"), GPU("g1", "A100", index=1)),
        ),
        Node("n2", cpu_milli=64_000, memory_mib=1 << 20, gpus=(GPU("g2", "H100"),)),
    ]
)
CAPACITY = {"g0": 1000, "g1": 1000, "g2": 1000}

op = st.one_of(
    st.tuples(st.just("place"), st.sampled_from([250, 500, 1000, 2000]), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("preempt"), st.sampled_from([500, 1000])),
    st.tuples(st.just("restart")),
)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def request(n: int, milli: int, spot: bool) -> Request:
    shape = {"num_gpu": milli // 1000} if milli >= 1000 else {"gpu_milli": milli}
    return Request(
        f"u{n % 3}/s{n}",
        owner=f"u{n % 3}",
        priority="preemptible" if spot else "on-demand",
        **shape,  # type: ignore[arg-type]
    )


def check_capacity(intervals) -> None:
    """At no instant where an interval starts do a device's open intervals hold more than it."""
    for t in {i.start for i in intervals}:
        held: dict[str, int] = {}
        for i in intervals:
            if i.start <= t and (i.end is None or i.end > t):
                held[i.holding.device] = held.get(i.holding.device, 0) + i.holding.milli
        assert all(m <= CAPACITY[d] for d, m in held.items()), (t, held)


def run(ops, root: Path, crash: bool):
    """Play `ops` on a real allocator feeding a real ledger; returns (ledger intervals, the
    allocator's own record {id: (milli, granted, ended, why)}, ids held at the end, now)."""
    clock = Clock()
    ledger = LedgerStore(f"sqlite:///{root}/ledger.sqlite")
    alloc_store = SQLiteStore(f"sqlite:///{root}/alloc.sqlite")
    allocator = Allocator(INVENTORY, store=alloc_store, clock=clock)
    feed = LedgerFeed(ledger, lambda: INVENTORY, clock=clock)
    allocator.add_listener(feed.listener)
    record: dict[str, list] = {}
    numbers = itertools.count()
    try:
        for (kind, *args), dt in ops:
            clock.t += dt
            if kind == "place":
                try:
                    p = allocator.place(request(next(numbers), args[0], args[1]))
                except (NoCapacity, QuotaExceeded):
                    continue
                record[p.id] = [p.gpu_milli, round(p.created_at), None, None]
            elif kind == "release":
                held = [p.id for p in allocator.allocations()]
                if held:
                    victim = held[args[0] % len(held)]
                    allocator.release(victim)
                    record[victim][2:] = [round(clock.t), RELEASED]
            elif kind == "preempt":
                try:
                    p, victims = allocator.preempt_and_place(request(next(numbers), args[0], False))
                except (NoCapacity, QuotaExceeded):
                    continue
                for v in victims:
                    record[v.id][2:] = [round(clock.t), PREEMPTED]
                record[p.id] = [p.gpu_milli, round(p.created_at), None, None]
            else:  # the hub restarts: its allocator is rebuilt from its store, then reconciled
                if not crash:
                    feed.flush()  # a clean stop writes what is queued; a crash loses it
                alloc_store.close()
                alloc_store = SQLiteStore(f"sqlite:///{root}/alloc.sqlite")
                allocator = Allocator(INVENTORY, store=alloc_store, clock=clock)
                feed = LedgerFeed(ledger, lambda: INVENTORY, clock=clock)
                allocator.add_listener(feed.listener)
                allocator.notify_listeners()
            if dt % 3 == 0:  # writes lag behind changes now and then
                feed.flush()
        feed.flush()
        held_now = {p.id for p in allocator.allocations()}
        now = round(clock.t) + 1
        return ledger.intervals(0, now), record, held_now, now
    finally:
        alloc_store.close()
        ledger.close()


OPS = st.lists(st.tuples(op, st.integers(0, 5000)), min_size=1, max_size=40)
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(ops=OPS)
def test_the_ledger_never_exceeds_capacity_and_matches_the_allocator_exactly(ops, tmp_path_factory):
    intervals, record, held_now, now = run(ops, tmp_path_factory.mktemp("ledger"), crash=False)
    check_capacity(intervals)
    got: dict[str, int] = {}
    for i in intervals:
        got[i.holding.allocation_id] = got.get(i.holding.allocation_id, 0) + i.milli_seconds(0, now)
    assert set(got) <= set(record)
    for aid, (milli, granted, ended, why) in record.items():
        assert got.get(aid, 0) == milli * ((now if ended is None else ended) - granted), aid
        closed = {i.end_reason for i in intervals if i.holding.allocation_id == aid and not i.open}
        assert closed == (set() if why is None else {why}), (aid, closed, why)
    assert {i.holding.allocation_id for i in intervals if i.open} == held_now


@SETTINGS
@given(ops=OPS)
def test_after_crashes_the_ledger_still_never_exceeds_capacity_and_holds_what_is_held(
    ops, tmp_path_factory
):
    intervals, record, held_now, now = run(ops, tmp_path_factory.mktemp("ledger"), crash=True)
    check_capacity(intervals)
    assert {i.holding.allocation_id for i in intervals if i.open} == held_now
    for aid, (_, granted, _, _) in record.items():
        # what a crash lost is counted up to the restart's reconciliation, never before the grant
        starts = [i.start for i in intervals if i.holding.allocation_id == aid]
        assert all(s >= granted for s in starts), aid
