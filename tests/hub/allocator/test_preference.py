"""Placement next to the notebook (decision 0003): a preferred node and NVLink group, soft."""

from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulab.hub.allocator import (
    GPU,
    POLICIES,
    RACK_LABEL,
    AllocationError,
    Allocator,
    InvalidRequest,
    Inventory,
    NoCapacity,
    Node,
    Request,
)
from gpulab.hub.allocator.store import request_from_dict, request_to_dict


def rack_of(inv: Inventory, node: str) -> str | None:
    return inv.nodes[inv.index_of(node)].rack


@pytest.fixture
def racks(make_node) -> Inventory:
    """Two racks of two 4-GPU nodes, each node with NVLink groups x (GPUs 0-1) and y (2-3)."""
    links = ["x", "x", "y", "y"]
    return Inventory(
        make_node(f"r{r}n{k}", gpus=4, rack=f"rack{r}", nvlink_groups=list(links))
        for r in range(2)
        for k in range(2)
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_preferred_node_wins_over_the_policys_choice(racks, policy):
    alloc = Allocator(racks, policy=policy, seed=1)
    alloc.place(Request("fill", num_gpu=1))  # best-fit and gpulab would pack next to it
    for k in range(3):
        p = alloc.place(Request(f"w{k}", gpu_milli=500, preferred_node="r1n1"))
        assert p.node == "r1n1"


def test_a_full_preferred_node_spills_to_its_rack_then_anywhere(racks):
    for seed in range(4):
        alloc = Allocator(racks, policy="random", seed=seed)
        placed = [
            alloc.place(Request(f"w{k}", num_gpu=1, preferred_node="r0n1")) for k in range(16)
        ]
        assert [p.node for p in placed[:4]] == ["r0n1"] * 4
        assert {p.node for p in placed[4:8]} == {"r0n0"}  # the notebook's rack next
        assert {rack_of(racks, p.node) for p in placed[8:]} == {"rack1"}  # then anywhere
        # full everywhere now: the usual refusal, not one about the preference
        with pytest.raises(NoCapacity) as err:
            alloc.place(Request("w16", num_gpu=1, preferred_node="r0n1"))
        assert "r0n1" not in err.value.reason


def test_the_rack_comes_before_the_affinity_groups_rack(racks):
    alloc = Allocator(racks, policy="first-fit")
    alloc.place(Request("dask-sched", cpu_milli=1000, affinity_group="c1"))  # first-fit: rack0
    alloc.place(Request("notebook-fill", num_gpu=4, preferred_node="r1n0"))
    p = alloc.place(Request("w", num_gpu=1, preferred_node="r1n0", affinity_group="c1"))
    assert p.node == "r1n1"


def test_without_a_rack_a_full_preferred_node_falls_back_to_the_affinity_rack(make_node):
    inv = Inventory(
        [
            make_node("a", gpus=1, rack="ra"),
            make_node("b", gpus=1, rack="rb"),
            make_node("c", gpus=2, rack="rb"),
            make_node("lonely", gpus=1),
        ]
    )
    alloc = Allocator(inv, policy="first-fit")
    alloc.place(Request("nb", num_gpu=1, preferred_node="lonely", affinity_group="g"))
    alloc.place(Request("s", cpu_milli=1, preferred_node="b", affinity_group="g"))
    p = alloc.place(Request("w", num_gpu=1, preferred_node="lonely", affinity_group="g"))
    assert p.node in {"b", "c"}  # the group's rack, not first-fit's "a"


def test_on_the_preferred_node_the_preferred_nvlink_group_comes_first(racks):
    alloc = Allocator(racks, policy="first-fit")
    near = {"preferred_node": "r0n0", "preferred_nvlink_group": "y"}
    whole = alloc.place(Request("pair", num_gpu=2, **near))
    assert {s.uuid for s in whole.gpus} == {"r0n0-gpu2", "r0n0-gpu3"}
    frac = alloc.place(
        Request("quarter", gpu_milli=250, preferred_node="r0n0", preferred_nvlink_group="x")
    )
    assert [s.uuid for s in frac.gpus] in (["r0n0-gpu0"], ["r0n0-gpu1"])
    # group y is full: the node still wins, on another group's GPU
    spill = alloc.place(Request("one", num_gpu=1, **near))
    assert spill.node == "r0n0" and spill.gpus[0].uuid in {"r0n0-gpu0", "r0n0-gpu1"}


def test_fractions_fill_the_preferred_group_before_leaving_it(racks):
    alloc = Allocator(racks, policy="best-fit")
    near = {"preferred_node": "r1n0", "preferred_nvlink_group": "y"}
    uuids = [alloc.place(Request(f"f{k}", gpu_milli=500, **near)).gpus[0].uuid for k in range(5)]
    assert sorted(uuids[:4]) == ["r1n0-gpu2", "r1n0-gpu2", "r1n0-gpu3", "r1n0-gpu3"]
    assert uuids[4] in {"r1n0-gpu0", "r1n0-gpu1"}


def test_an_unknown_preferred_node_or_group_places_as_without_one(racks):
    a = Allocator(racks, policy="best-fit")
    b = Allocator(racks, policy="best-fit")
    for k in range(6):
        pa = a.place(Request(f"w{k}", num_gpu=1, preferred_node="gone"))
        pb = b.place(Request(f"w{k}", num_gpu=1))
        assert pa.gpus == pb.gpus
    p = a.place(Request("g", num_gpu=1, preferred_node="r1n1", preferred_nvlink_group="zz"))
    assert p.node == "r1n1"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"preferred_node": ""}, "preferred_node"),
        ({"preferred_node": 3}, "preferred_node"),
        ({"preferred_node": "n", "preferred_nvlink_group": ""}, "preferred_nvlink_group"),
        ({"preferred_nvlink_group": "x"}, "preferred_nvlink_group"),
    ],
)
def test_bad_preferences_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequest, match=field):
        Request("r", num_gpu=1, **kw)


def test_preferences_survive_the_store():
    r = Request("r", num_gpu=1, preferred_node="n", preferred_nvlink_group="x")
    assert request_from_dict(request_to_dict(r)) == r
    # without a preference the row (and a pod's placement annotation) reads as before 0003
    old = request_to_dict(Request("old", num_gpu=1))
    assert "preferred_node" not in old and "preferred_nvlink_group" not in old
    assert request_from_dict(old) == Request("old", num_gpu=1)


# -- properties -------------------------------------------------------------------------------

INVENTORY = Inventory(
    [
        Node(
            f"n{i}",
            16_000,
            64_000,
            tuple(
                GPU(f"n{i}g{j}", "A100" if i < 3 else "V100", index=j, nvlink_group="xy"[j // 2])
                for j in range(4)
            ),
            labels={RACK_LABEL: f"rack{i // 2}"},
        )
        for i in range(5)
    ]
    + [Node("cpu", 32_000, 64_000)]
)
NODES = [n.name for n in INVENTORY.nodes] + ["elsewhere"]

requests = st.builds(
    lambda kind, size, cpu, model, node, group, affinity: Request(
        id="?",
        cpu_milli=cpu * 1000,
        num_gpu=size if kind == "whole" else 0,
        gpu_milli=size * 125 if kind == "frac" else 0,
        gpu_models=frozenset({model}) if model else frozenset(),
        preferred_node=node,
        preferred_nvlink_group=group if node else None,
        affinity_group=affinity,
    ),
    kind=st.sampled_from(["whole", "frac", "cpu"]),
    size=st.integers(1, 4),
    cpu=st.integers(0, 6),
    model=st.sampled_from([None, "A100", "V100"]),
    node=st.one_of(st.none(), st.sampled_from(NODES)),
    group=st.sampled_from([None, "x", "y"]),
    affinity=st.sampled_from([None, "c1"]),
)
EXAMPLES = int(os.environ.get("GPULAB_HYPOTHESIS_EXAMPLES", "60"))
SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


def group_fits(alloc: Allocator, req: Request) -> bool:
    """Whether the preferred node's preferred NVLink group alone could hold the GPUs."""
    i = INVENTORY.index_of(req.preferred_node)
    node = INVENTORY.nodes[i]
    free = alloc._state.gpu_free[i]
    ok = [
        j
        for j, g in enumerate(node.gpus)
        if g.nvlink_group == req.preferred_nvlink_group
        and (not req.gpu_models or g.model in req.gpu_models)
    ]
    if req.gpu_milli:
        return any(free[j] >= req.gpu_milli for j in ok)
    return any(
        sum(1 for j in ok if free[j] == 1000 and node.gpus[j].model == m) >= req.num_gpu
        for m in {"A100", "V100"}
    )


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK)
@given(policy=st.sampled_from(sorted(POLICIES)), sequence=st.lists(requests, max_size=40))
def test_a_preference_orders_placements_and_never_refuses(policy, sequence, assert_consistent):
    alloc = Allocator(INVENTORY, policy=policy, seed=0)
    for k, raw in enumerate(sequence):
        req = Request(**{**raw.__dict__, "id": f"r{k}"})
        plain = Request(
            **{
                **req.__dict__,
                "id": f"plain{k}",
                "preferred_node": None,
                "preferred_nvlink_group": None,
            }
        )
        i = INVENTORY.index_of(req.preferred_node) if req.preferred_node else None
        state = alloc._state
        here = i is not None and alloc.policy.choose(state, req.shape, [i]) is not None
        rack = INVENTORY.nodes[i].rack if i is not None else None
        rack_nodes = [j for j, n in enumerate(INVENTORY.nodes) if rack and n.rack == rack]
        in_rack = bool(rack_nodes) and alloc.policy.choose(state, req.shape, rack_nodes) is not None
        in_group = (
            here and req.preferred_nvlink_group and req.total_gpu_milli and group_fits(alloc, req)
        )
        try:
            p = alloc.place(req)
        except AllocationError:
            # the same request without a preference is refused too: preferences never refuse
            with pytest.raises(AllocationError):
                alloc.place(plain)
            continue
        if here:
            assert p.node == req.preferred_node
        elif in_rack:
            assert INVENTORY.nodes[INVENTORY.index_of(p.node)].rack == rack
        if in_group:
            groups = {
                g.nvlink_group
                for g in INVENTORY.nodes[i].gpus
                if g.uuid in {s.uuid for s in p.gpus}
            }
            assert groups == {req.preferred_nvlink_group}
        assert_consistent(alloc)
        if k % 3 == 2:
            with contextlib.suppress(AllocationError):
                alloc.release(f"r{k - 1}")
