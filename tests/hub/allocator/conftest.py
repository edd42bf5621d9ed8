"""Fixtures for allocator tests: small hand-made inventories."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpulab.hub.allocator import GPU, RACK_LABEL, Allocator, Inventory, Node


def make_node(
    name: str,
    gpus: int = 4,
    model: str = "A100",
    cpu_milli: int = 64_000,
    memory_mib: int = 262_144,
    rack: str | None = None,
    nvlink_groups: list[str | None] | None = None,
) -> Node:
    """A node with ``gpus`` GPUs named ``<name>-gpu<i>``."""
    links = nvlink_groups or [None] * gpus
    return Node(
        name=name,
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        gpus=tuple(
            GPU(uuid=f"{name}-gpu{i}", model=model, index=i, nvlink_group=links[i])
            for i in range(gpus)
        ),
        labels={RACK_LABEL: rack} if rack else {},
    )


@pytest.fixture(name="make_node")
def make_node_fixture() -> Callable[..., Node]:
    """The ``make_node`` factory."""
    return make_node


@pytest.fixture
def small_inventory() -> Inventory:
    """Two A100 nodes with 4 GPUs and one V100 node with 2."""
    return Inventory([make_node("a1"), make_node("a2"), make_node("v1", gpus=2, model="V100M32")])


def assert_consistent(alloc: Allocator) -> None:
    """No GPU, CPU or memory over-committed; state, quota ledger and store agree."""
    inv = alloc.inventory
    cpu = {n.name: 0 for n in inv.nodes}
    mem = {n.name: 0 for n in inv.nodes}
    gpu: dict[str, int] = {g.uuid: 0 for n in inv.nodes for g in n.gpus}
    owner_gpu_node = {g.uuid: n.name for n in inv.nodes for g in n.gpus}
    usage: dict[str, int] = {}
    for p in alloc.allocations():
        r = p.request
        cpu[p.node] += r.cpu_milli
        mem[p.node] += r.memory_mib
        assert sum(s.milli for s in p.gpus) == r.total_gpu_milli
        if r.num_gpu:
            assert len(p.gpus) == r.num_gpu and all(s.milli == 1000 for s in p.gpus)
            assert len({s.uuid for s in p.gpus}) == r.num_gpu
        for s in p.gpus:
            assert owner_gpu_node[s.uuid] == p.node, "a request spans nodes"
            gpu[s.uuid] += s.milli
            if r.gpu_models:
                model = next(g.model for n in inv.nodes for g in n.gpus if g.uuid == s.uuid)
                assert model in r.gpu_models
        usage[r.owner] = usage.get(r.owner, 0) + r.total_gpu_milli
    for n in inv.nodes:
        assert cpu[n.name] <= n.cpu_milli, f"CPU over-committed on {n.name}"
        assert mem[n.name] <= n.memory_mib, f"memory over-committed on {n.name}"
    assert all(v <= 1000 for v in gpu.values()), "a GPU is over-committed"
    state = alloc._state
    for i, n in enumerate(inv.nodes):
        assert state.cpu_free[i] == n.cpu_milli - cpu[n.name]
        assert state.mem_free[i] == n.memory_mib - mem[n.name]
        assert state.gpu_free[i] == [1000 - gpu[g.uuid] for g in n.gpus]
        assert state.sig(i) in state.sigs and i in state.groups[state.node_sid[i]]
    assert alloc.used_gpu_milli == sum(gpu.values())
    for owner, milli in usage.items():
        assert alloc.usage_milli(owner) == milli
    stored = {p.id for p in alloc.store.load()} - {s.placement.id for s in alloc.stale}
    assert stored == {p.id for p in alloc.allocations()}


@pytest.fixture(name="assert_consistent")
def assert_consistent_fixture() -> Callable[[Allocator], None]:
    """The ``assert_consistent(allocator)`` checker."""
    return assert_consistent
