"""Headroom: a share of GPU capacity only on-demand requests may use."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import Allocator, Inventory, NoCapacity, Request


def test_preemptible_requests_stop_at_the_headroom(make_node):
    inv = Inventory([make_node(f"n{i}", gpus=4) for i in range(5)])  # 20 GPUs
    alloc = Allocator(inv, headroom_fraction=0.15)  # 3 GPUs reserved
    spot = Request("probe", num_gpu=1, priority="preemptible")
    assert alloc.capacity(spot) == 17
    for k in range(17):
        alloc.place(Request(f"s{k}", num_gpu=1, priority="preemptible"))
    with pytest.raises(NoCapacity) as err:
        alloc.place(Request("s17", num_gpu=1, priority="preemptible"))
    assert "on-demand" in err.value.reason
    assert alloc.capacity(spot) == 0
    for k in range(3):
        alloc.place(Request(f"od{k}", num_gpu=1))


def test_headroom_counts_fractions_exactly(make_node):
    inv = Inventory([make_node("n", gpus=1)])
    alloc = Allocator(inv, headroom_fraction=0.25)
    for k in range(6):
        alloc.place(Request(f"s{k}", gpu_milli=125, priority="preemptible"))
    assert alloc.capacity(Request("p", gpu_milli=125, priority="preemptible")) == 0
    assert alloc.capacity(Request("p", gpu_milli=125)) == 2


def test_headroom_fraction_must_be_a_share():
    with pytest.raises(ValueError, match="headroom_fraction"):
        Allocator(Inventory([]), headroom_fraction=1.5)
