"""Fixtures for allocator tests: small hand-made inventories."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpulab.hub.allocator import GPU, RACK_LABEL, Inventory, Node


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
