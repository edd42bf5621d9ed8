"""Place, release, capacity and errors over the public API."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import (
    POLICIES,
    Allocator,
    AlreadyAllocated,
    InvalidRequest,
    Inventory,
    NoCapacity,
    Request,
)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_places_a_whole_gpu_request_on_one_node(small_inventory, policy):
    alloc = Allocator(small_inventory, policy=policy, seed=1)
    p = alloc.place(Request("alice/x", owner="alice", num_gpu=3))
    assert len(p.gpus) == 3
    assert len({s.uuid for s in p.gpus}) == 3
    assert all(s.milli == 1000 and s.uuid.startswith(p.node) for s in p.gpus)


def test_cpu_only_request_gets_a_node_and_no_gpus(small_inventory):
    alloc = Allocator(small_inventory)
    p = alloc.place(Request("bob/cpu", cpu_milli=2000, memory_mib=1024))
    assert p.gpus == ()
    assert p.node in {"a1", "a2", "v1"}


def test_release_is_idempotent_and_frees_capacity(small_inventory):
    alloc = Allocator(small_inventory)
    shape = Request("probe", num_gpu=4)
    assert alloc.capacity(shape) == 2
    alloc.place(Request("a", num_gpu=4))
    assert alloc.capacity(shape) == 1
    assert alloc.release("a") is not None
    assert alloc.release("a") is None
    assert alloc.capacity(shape) == 2
    assert alloc.get("a") is None


def test_same_id_twice_is_refused(small_inventory):
    alloc = Allocator(small_inventory)
    alloc.place(Request("alice/x", num_gpu=1))
    with pytest.raises(AlreadyAllocated):
        alloc.place(Request("alice/x", num_gpu=1))


def test_fraction_capacity_counts_exact_eighths(small_inventory):
    alloc = Allocator(small_inventory)
    eighth = Request("probe", gpu_milli=125)
    assert alloc.capacity(eighth) == 10 * 8
    for k in range(8):
        alloc.place(Request(f"e{k}", gpu_milli=125))
    assert alloc.capacity(eighth) == 9 * 8
    assert alloc.used_gpu_milli == 1000


def test_best_fit_packs_fractions_onto_one_gpu(small_inventory):
    alloc = Allocator(small_inventory, policy="best-fit")
    placements = [alloc.place(Request(f"q{k}", gpu_milli=250)) for k in range(4)]
    assert len({p.gpus[0].uuid for p in placements}) == 1


def test_first_fit_uses_inventory_order(small_inventory):
    alloc = Allocator(small_inventory, policy="first-fit")
    assert alloc.place(Request("x", num_gpu=1)).gpus[0].uuid == "a1-gpu0"
    assert alloc.place(Request("y", num_gpu=1)).gpus[0].uuid == "a1-gpu1"


def test_too_many_gpus_says_the_largest_free_block(small_inventory):
    alloc = Allocator(small_inventory)
    alloc.place(Request("a", num_gpu=3))
    alloc.place(Request("b", num_gpu=3))
    with pytest.raises(NoCapacity) as err:
        alloc.place(Request("c", num_gpu=2, gpu_models=frozenset({"A100"})))
    assert "largest free block: 1" in err.value.reason
    assert "A100" in err.value.reason


def test_unknown_model_is_refused_with_the_models_available(small_inventory):
    alloc = Allocator(small_inventory)
    with pytest.raises(NoCapacity) as err:
        alloc.place(Request("a", num_gpu=1, gpu_models=frozenset({"H100"})))
    assert "A100" in err.value.reason and "V100M32" in err.value.reason


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_gpu": -1},
        {"num_gpu": 1, "gpu_milli": 500},
        {"gpu_milli": 1000},
        {"cpu_milli": -5},
        {"priority": "gold"},
    ],
)
def test_malformed_requests_are_invalid(kwargs):
    with pytest.raises(InvalidRequest):
        Request("bad", **kwargs)


def test_cpu_and_memory_bind_as_well_as_gpus(make_node):
    inv = Inventory([make_node("n", gpus=4, cpu_milli=8000, memory_mib=1000)])
    alloc = Allocator(inv)
    alloc.place(Request("a", num_gpu=1, cpu_milli=6000))
    assert alloc.capacity(Request("p", num_gpu=1, cpu_milli=6000)) == 0
    with pytest.raises(NoCapacity) as err:
        alloc.place(Request("b", num_gpu=1, cpu_milli=6000))
    assert "CPU" in err.value.reason


def test_inventory_rejects_duplicate_names_and_uuids(make_node):
    with pytest.raises(ValueError, match="appears twice"):
        Inventory([make_node("n"), make_node("n")])
