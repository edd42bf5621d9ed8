"""Persistence in SQLite: reload, stale rows, atomic preemption."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import (
    Allocator,
    Inventory,
    Quota,
    Request,
    SQLiteStore,
    StaleAllocations,
)


def test_allocations_survive_a_restart(tmp_path, small_inventory):
    url = f"sqlite:///{tmp_path}/alloc.sqlite"
    a = Allocator.open(small_inventory, url, quota=Quota(users={"alice": 2000}))
    p = a.place(Request("alice/x", owner="alice", groups=frozenset({"g"}), gpu_milli=375))
    a.place(Request("bob/y", owner="bob", num_gpu=2, priority="preemptible"))
    a.release("bob/y")
    a.store.close()
    b = Allocator.open(small_inventory, url, quota=Quota(users={"alice": 2000}))
    assert b.allocations() == [p]
    assert b.usage_milli("alice") == 375
    assert b.quota_left_milli("alice", frozenset()) == 1625
    assert b.stale == []


def test_rows_that_no_longer_fit_are_reported_not_loaded(tmp_path, make_node):
    url = f"sqlite:///{tmp_path}/alloc.sqlite"
    big = Inventory([make_node("n1", gpus=4), make_node("n2", gpus=4)])
    a = Allocator.open(big, url, policy="first-fit")
    a.place(Request("x", num_gpu=4))
    a.place(Request("y", num_gpu=4))
    a.store.close()
    small = Inventory([make_node("n1", gpus=4)])
    b = Allocator.open(small, url)
    assert [p.id for p in b.allocations()] == ["x"]
    assert [s.placement.id for s in b.stale] == ["y"]
    assert "n2" in b.stale[0].reason
    b.release("y")
    assert b.stale == []
    b.store.close()
    with pytest.raises(StaleAllocations):
        Allocator.open(Inventory([]), url, strict=True)


def test_in_memory_sqlite_url_works(small_inventory):
    a = Allocator.open(small_inventory, "sqlite://")
    a.place(Request("x", num_gpu=1))
    assert len(a.store.load()) == 1


def test_relative_and_absolute_urls_map_to_paths():
    from gpulab.hub.allocator.store import sqlite_path

    assert sqlite_path("sqlite:///gpulab.sqlite") == "gpulab.sqlite"
    assert sqlite_path("sqlite:////srv/gpulab.sqlite") == "/srv/gpulab.sqlite"
    with pytest.raises(ValueError, match="sqlite"):
        sqlite_path("postgresql://db/x")


def test_a_failed_write_leaves_no_allocation(small_inventory):
    class Broken(SQLiteStore):
        def commit(self, add, remove):
            raise OSError("disk full")

    a = Allocator(small_inventory, store=Broken("sqlite://"))
    with pytest.raises(OSError):
        a.place(Request("x", num_gpu=4))
    assert a.allocations() == []
    assert a.used_gpu_milli == 0
    assert a.capacity(Request("p", num_gpu=4)) == 2


def test_a_gpu_whose_model_changed_makes_its_allocation_stale(tmp_path, make_node):
    url = f"sqlite:///{tmp_path}/alloc.sqlite"
    a = Allocator.open(Inventory([make_node("n", gpus=2)]), url)
    a.place(Request("x", num_gpu=1, gpu_models=frozenset({"A100"})))
    a.place(Request("y", num_gpu=1))
    a.store.close()
    b = Allocator.open(Inventory([make_node("n", gpus=2, model="T4")]), url)
    assert [p.id for p in b.allocations()] == ["y"]
    assert "T4" in b.stale[0].reason
