"""Cache limits, signature renumbering and the latency budget keep placements valid."""

from __future__ import annotations

import random

import pytest

from gpulab.hub.allocator import POLICIES, AllocationError, Allocator, Inventory, Request
from gpulab.hub.allocator.policies import GpulabPolicy, ScoredPolicy
from gpulab.hub.allocator.state import ClusterState


def churn(alloc: Allocator, steps: int, seed: int) -> int:
    """Random places and releases; returns how many placements succeeded."""
    rng = random.Random(seed)
    placed = 0
    for k in range(steps):
        live = alloc.allocations()
        if live and rng.random() < 0.35:
            alloc.release(rng.choice(live).id)
            continue
        kind = rng.choice(["whole", "frac", "cpu"])
        req = Request(
            f"r{k}",
            owner=f"u{k % 5}",
            cpu_milli=rng.randrange(0, 9000, 500),
            memory_mib=rng.randrange(0, 20000, 1000),
            num_gpu=rng.choice([1, 2, 4]) if kind == "whole" else 0,
            gpu_milli=rng.randrange(50, 1000, 50) if kind == "frac" else 0,
        )
        try:
            alloc.place(req)
            placed += 1
        except AllocationError:
            pass
    return placed


@pytest.fixture
def cluster(make_node) -> Inventory:
    return Inventory(
        [make_node(f"n{i}", gpus=(1, 2, 4, 8)[i % 4], cpu_milli=32_000) for i in range(24)]
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_signature_renumbering_keeps_state_and_caches_consistent(
    policy, cluster, monkeypatch, assert_consistent
):
    monkeypatch.setattr(ClusterState, "intern_limit", 40)
    alloc = Allocator(cluster, policy=policy, seed=3)
    assert churn(alloc, 400, seed=1) > 50
    assert alloc._state.generation > 0
    assert_consistent(alloc)


def test_score_cache_limit_only_costs_time(cluster, monkeypatch, assert_consistent):
    monkeypatch.setattr(ScoredPolicy, "cache_limit", 25)
    limited = Allocator(cluster, policy="best-fit")
    full = Allocator(cluster, policy="best-fit")
    churn(limited, 300, seed=2)
    churn(full, 300, seed=2)
    assert [p.gpus for p in limited.allocations()] == [p.gpus for p in full.allocations()]
    assert_consistent(limited)


def test_a_tiny_latency_budget_still_finds_a_node_whenever_one_fits(cluster, assert_consistent):
    budgeted = Allocator(cluster, policy=GpulabPolicy(budget=1))
    for k in range(300):
        req = Request(f"r{k}", gpu_milli=50 * (1 + k % 19), cpu_milli=500 * (k % 7))
        fits = budgeted._state.fits_request(req)
        try:
            budgeted.place(req)
            assert fits
        except AllocationError:
            assert not fits
    assert_consistent(budgeted)
