"""Placement policies: fragmentation model, FGD and gpulab's choices on hand-made cases."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulab.hub.allocator import Allocator, Inventory, Request
from gpulab.hub.allocator.frag import FragModel
from gpulab.hub.allocator.policies import FGD, GpulabPolicy
from gpulab.hub.allocator.state import ClusterState
from gpulab.hub.allocator.workload import TaskType, typical_tasks

WHOLE = TaskType(
    cpu_milli=1000, memory_mib=0, num_gpu=1, milli_per_gpu=1000, models=frozenset(), weight=1.0
)


def test_typical_tasks_keep_the_most_common_kinds_and_renormalise():
    reqs = (
        [Request(f"a{i}", num_gpu=1) for i in range(90)]
        + [Request(f"b{i}", gpu_milli=500) for i in range(9)]
        + [Request("c", cpu_milli=100)]
    )
    tasks = typical_tasks(reqs, popularity=0.95)
    assert [(t.num_gpu, t.milli_per_gpu) for t in tasks] == [(1, 1000), (1, 500)]
    assert sum(t.weight for t in tasks) == pytest.approx(1.0)
    assert tasks[0].weight == pytest.approx(90 / 99)


def test_fragmentation_counts_gpus_too_small_for_the_workload(make_node):
    inv = Inventory([make_node("n", gpus=2)])
    state = ClusterState(inv)
    model = FragModel([WHOLE])
    cls = state.classes[0]
    assert model.frag(0, cls, 64_000, 1, (1000, 1000)) == 0
    assert model.frag(0, cls, 64_000, 1, (500, 1000)) == 500  # the half GPU fits no whole task
    assert model.frag(0, cls, 500, 1, (1000, 1000)) == 2000  # no CPU left: all of it


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    gpus=st.lists(st.integers(0, 1000), min_size=1, max_size=8).map(lambda g: tuple(sorted(g))),
    cpu=st.integers(0, 20_000),
    mem=st.integers(0, 40_000),
)
def test_fast_fragmentation_path_equals_the_general_one(gpus, cpu, mem, make_node):
    tasks = [
        TaskType(4000, 8000, 1, 250, frozenset(), 0.3),
        TaskType(12000, 30000, 1, 1000, frozenset({"A100"}), 0.3),
        TaskType(2000, 1000, 2, 1000, frozenset(), 0.2),
        TaskType(8000, 2000, 0, 0, frozenset(), 0.1),
        TaskType(1000, 500, 1, 600, frozenset({"T4"}), 0.1),
    ]
    inv = Inventory([make_node("n", gpus=len(gpus), cpu_milli=20_000, memory_mib=40_000)])
    cls = ClusterState(inv).classes[0]
    model = FragModel(tasks)
    cl, ml = model.levels(cpu, mem)
    total = sum(gpus)
    fast = model._frag_sorted(0, cls, cl, ml, gpus, total) if total else 0.0
    general = model._frag_general(cls, cl, ml, gpus, total) if total else 0.0
    assert fast == pytest.approx(general)


def test_fgd_puts_a_fraction_where_it_keeps_whole_gpus_free(make_node):
    inv = Inventory([make_node("n", gpus=4)])
    alloc = Allocator(inv, policy=FGD(workload=[WHOLE]))
    first = alloc.place(Request("half1", gpu_milli=500))
    second = alloc.place(Request("half2", gpu_milli=500))
    assert first.gpus[0].uuid == second.gpus[0].uuid
    assert alloc.capacity(Request("probe", num_gpu=3)) == 1


def test_gpulab_keeps_unconstrained_work_off_the_model_constrained_work_needs(make_node):
    inv = Inventory([make_node("t4", gpus=2, model="T4"), make_node("g2", gpus=2, model="G2")])
    workload = [
        TaskType(1000, 0, 1, 1000, frozenset({"T4"}), 0.5),
        TaskType(1000, 0, 1, 1000, frozenset(), 0.5),
    ]
    for tie_first in (True, False):
        nodes = inv.nodes if tie_first else tuple(reversed(inv.nodes))
        alloc = Allocator(Inventory(nodes), policy=GpulabPolicy(workload=workload))
        p = alloc.place(Request("any", num_gpu=1))
        assert p.node == "g2"


def test_gpulab_sends_cpu_only_work_where_cpu_is_plentiful(make_node):
    inv = Inventory(
        [
            make_node("gpu-heavy", gpus=8, cpu_milli=32_000, memory_mib=262_144),
            make_node("cpu-rich", gpus=2, cpu_milli=104_000, memory_mib=262_144),
        ]
    )
    workload = [
        TaskType(4000, 8000, 1, 1000, frozenset(), 0.8),
        TaskType(8000, 8000, 0, 0, frozenset(), 0.2),
    ]
    alloc = Allocator(inv, policy=GpulabPolicy(workload=workload))
    assert alloc.place(Request("cpu-job", cpu_milli=8000, memory_mib=8000)).node == "cpu-rich"


def test_gpulab_learns_the_workload_when_none_is_given(small_inventory, assert_consistent):
    policy = GpulabPolicy()
    alloc = Allocator(small_inventory, policy=policy)
    for k in range(40):
        alloc.place(Request(f"r{k}", gpu_milli=125 * (1 + k % 3)))
    assert policy.model.tasks, "the mix should have been estimated from what was placed"
    assert_consistent(alloc)


def test_default_policy_is_gpulab(small_inventory):
    assert Allocator(small_inventory).policy.name == "gpulab"
