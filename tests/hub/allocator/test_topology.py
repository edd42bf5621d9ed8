"""Model constraints, NVLink groups and rack affinity."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import Allocator, Inventory, NoCapacity, Request


def test_model_constraint_is_honoured(small_inventory):
    alloc = Allocator(small_inventory)
    p = alloc.place(Request("x", num_gpu=1, gpu_models=frozenset({"V100M16", "V100M32"})))
    assert p.node == "v1"
    assert alloc.capacity(Request("p", num_gpu=1, gpu_models=frozenset({"V100M32"}))) == 1


def test_nvlink_request_stays_in_one_group(make_node):
    groups = ["a", "a", "b", "b"]
    inv = Inventory([make_node("n", gpus=4, nvlink_groups=list(groups))])
    alloc = Allocator(inv, policy="first-fit")
    alloc.place(Request("one", num_gpu=1))  # takes gpu0 (group a)
    p = alloc.place(Request("pair", num_gpu=2, nvlink=True))
    assert {s.uuid for s in p.gpus} == {"n-gpu2", "n-gpu3"}
    assert alloc.capacity(Request("p", num_gpu=2, nvlink=True)) == 0
    with pytest.raises(NoCapacity, match="NVLinked"):
        alloc.place(Request("pair2", num_gpu=2, nvlink=True))
    alloc.place(Request("pair3", num_gpu=1))


def test_nvlink_request_without_links_does_not_fit(make_node):
    alloc = Allocator(Inventory([make_node("n", gpus=4)]))
    with pytest.raises(NoCapacity):
        alloc.place(Request("pair", num_gpu=2, nvlink=True))


def test_affinity_group_prefers_the_rack_it_already_runs_in(make_node):
    nodes = [make_node(f"r{r}n{k}", gpus=2, rack=f"rack{r}") for r in range(3) for k in range(2)]
    inv = Inventory(nodes)
    for seed in range(5):
        alloc = Allocator(inv, policy="random", seed=seed)
        first = alloc.place(Request("nb", num_gpu=1, affinity_group="dask-1"))
        rack = inv.nodes[inv.index_of(first.node)].rack
        for k in range(3):
            p = alloc.place(Request(f"w{k}", num_gpu=1, affinity_group="dask-1"))
            assert inv.nodes[inv.index_of(p.node)].rack == rack
        # the rack is full now: the group spills over instead of failing
        spill = alloc.place(Request("w9", num_gpu=1, affinity_group="dask-1"))
        assert inv.nodes[inv.index_of(spill.node)].rack != rack


def test_mixed_model_node_prefers_one_model_for_multi_gpu(make_node):
    from gpulab.hub.allocator import GPU, Node

    node = Node(
        "mix",
        64000,
        262144,
        tuple(GPU(f"g{i}", "A100" if i < 2 else "T4", index=i) for i in range(4)),
    )
    alloc = Allocator(Inventory([node]))
    p = alloc.place(Request("x", num_gpu=2, gpu_models=frozenset({"T4"})))
    assert {s.uuid for s in p.gpus} == {"g2", "g3"}
    q = alloc.place(Request("y", num_gpu=2))
    assert {s.uuid for s in q.gpus} == {"g0", "g1"}
