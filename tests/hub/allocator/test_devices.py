"""Devices a cluster cuts GPUs into: MIG instances, time-slicing replicas, HAMi splits, GPUs
offered whole only. The allocator places against those, never against milli that no device can
hand out (the Kubernetes over-admission of issue 14)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulab.hub.allocator import (
    GPU,
    POLICIES,
    Allocator,
    Inventory,
    NoCapacity,
    Node,
    Quota,
    Request,
)


def mig_node(name: str = "mig", layout: dict[str, tuple[int, int]] | None = None) -> Node:
    """A node whose GPU is cut into MIG instances: profile -> (count, milli of the GPU)."""
    layout = layout or {"2g.20gb": (3, 250), "1g.10gb": (1, 125)}
    gpus = [
        GPU(
            f"{name}/mig-{profile}-{k}",
            "A100-SXM4-80GB",
            capacity_milli=milli,
            share_step_milli=milli,
            mig_profile=profile,
        )
        for profile, (count, milli) in layout.items()
        for k in range(count)
    ]
    return Node(name, 64_000, 262_144, tuple(gpus))


def replica_node(name: str = "ts", gpus: int = 4, replicas: int = 4) -> Node:
    """Time-slicing: each GPU offered as `replicas` replicas of one share each."""
    milli = min(999, 1000 // replicas)
    return Node(
        name,
        64_000,
        262_144,
        tuple(
            GPU(f"{name}/gpu-{g}/replica-{r}", "A100", capacity_milli=milli, share_step_milli=milli)
            for g in range(gpus)
            for r in range(replicas)
        ),
    )


def hami_node(name: str = "hami", gpus: int = 2, split: int = 10) -> Node:
    return Node(
        name,
        64_000,
        262_144,
        tuple(GPU(f"{name}/gpu-{g}", "A100", share_step_milli=1000 // split) for g in range(gpus)),
    )


def whole_only_node(name: str = "whole", gpus: int = 2) -> Node:
    return Node(
        name,
        64_000,
        262_144,
        tuple(GPU(f"{name}/gpu-{g}", "A100", share_step_milli=0) for g in range(gpus)),
    )


def fill(alloc: Allocator, milli: int, tries: int, owner: str = "u") -> list[str]:
    placed = []
    for i in range(tries):
        with contextlib.suppress(NoCapacity):
            placed.append(
                alloc.place(Request(f"{owner}/{i}", owner=owner, gpu_milli=milli)).gpus[0].uuid
            )
    return placed


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_mig_instances_take_one_share_each_and_never_a_whole_gpu_request(policy: str) -> None:
    alloc = Allocator(Inventory([mig_node()]), policy=policy)
    placed = fill(alloc, 250, 8)
    assert len(placed) == 3 and len(set(placed)) == 3  # three 2g.20gb instances, one share each
    assert all("2g.20gb" in u for u in placed)
    eighth = alloc.place(Request("v/0", owner="v", gpu_milli=125))
    assert eighth.gpus[0].uuid == "mig/mig-1g.10gb-0" and eighth.gpus[0].milli == 125
    with pytest.raises(NoCapacity, match="largest free share: 0 GPU"):
        alloc.place(Request("v/1", owner="v", gpu_milli=125))
    with pytest.raises(NoCapacity):
        alloc.place(Request("w/whole", owner="w", num_gpu=1))  # an instance is not a GPU


def test_a_small_share_on_a_bigger_instance_takes_the_whole_instance() -> None:
    alloc = Allocator(Inventory([mig_node(layout={"3g.40gb": (1, 500)})]), policy="best-fit")
    p = alloc.place(Request("a/0", owner="a", gpu_milli=125))
    assert p.gpus[0].milli == 500  # the share holds what it took
    assert alloc.usage_milli("a") == 125  # the quota counts what was asked
    assert alloc.capacity(Request("probe", gpu_milli=125)) == 0
    with pytest.raises(NoCapacity):
        alloc.place(Request("b/0", owner="b", gpu_milli=125))
    alloc.release("a/0")
    assert alloc.capacity(Request("probe", gpu_milli=125)) == 1


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_time_slicing_replicas_cap_shares_at_the_replica_count(policy: str) -> None:
    alloc = Allocator(Inventory([replica_node()]), policy=policy)
    assert alloc.capacity(Request("probe", gpu_milli=125)) == 16
    placed = fill(alloc, 125, 64)  # 64 eighth-GPU requests against 16 replicas
    assert len(placed) == 16 and len(set(placed)) == 16
    with pytest.raises(NoCapacity):
        alloc.place(Request("x/half", owner="x", gpu_milli=500))  # bigger than any replica
    with pytest.raises(NoCapacity):
        alloc.place(Request("x/whole", owner="x", num_gpu=1))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_hami_splits_cap_shares_per_gpu_and_keep_whole_gpus(policy: str) -> None:
    alloc = Allocator(Inventory([hami_node()]), policy=policy)
    assert alloc.capacity(Request("probe", gpu_milli=62)) == 20  # 10 splits x 2 GPUs
    placed = fill(alloc, 62, 40)
    assert len(placed) == 20
    assert all(placed.count(u) == 10 for u in set(placed))
    alloc2 = Allocator(Inventory([hami_node()]), policy=policy)
    alloc2.place(Request("w/1", owner="w", num_gpu=1))
    # 250 is 2.5 steps: rounded to 300, three fit on the GPU left
    assert alloc2.capacity(Request("probe", gpu_milli=250)) == 3


def test_gpus_offered_whole_only_refuse_fractions() -> None:
    alloc = Allocator(Inventory([whole_only_node()]))
    with pytest.raises(NoCapacity, match="slice or replica"):
        alloc.place(Request("a/q", owner="a", gpu_milli=250))
    assert alloc.place(Request("a/w", owner="a", num_gpu=2)).gpu_milli == 2000


def test_inventory_totals_count_what_devices_hold() -> None:
    inv = Inventory([mig_node(), replica_node(gpus=1)])
    assert inv.total_gpu_milli == 3 * 250 + 125 + 4 * 250


def test_device_shares_survive_a_reload(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'a.sqlite'}"
    inv = Inventory([mig_node(), replica_node(gpus=1)])
    first = Allocator.open(inv, url)
    before = {
        p.id: p.gpus
        for p in (first.place(Request(f"u/{i}", owner="u", gpu_milli=125)) for i in range(4))
    }
    first.store.close()
    again = Allocator.open(inv, url)
    assert not again.stale
    assert {p.id: p.gpus for p in again.allocations()} == before


def test_bad_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity_milli"):
        GPU("g", "A100", capacity_milli=0)
    with pytest.raises(ValueError, match="share_step_milli"):
        GPU("g", "A100", capacity_milli=250, share_step_milli=500)


NODES = [
    mig_node("m"),
    replica_node("t", gpus=2, replicas=3),
    hami_node("h", gpus=1, split=4),
    whole_only_node("w", 1),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["place", "release"]),
            st.integers(0, 11),
            st.sampled_from([0, 62, 125, 250, 333, 500, 999, 1000]),
        ),
        max_size=60,
    ),
    policy=st.sampled_from(sorted(POLICIES)),
)
def test_no_device_ever_holds_more_than_it_can(ops, policy) -> None:
    inv = Inventory(NODES)
    alloc = Allocator(inv, policy=policy, quota=Quota())
    devices = {g.uuid: g for n in inv.nodes for g in n.gpus}
    for op, k, milli in ops:
        rid = f"u{k}/s"
        if op == "release":
            alloc.release(rid)
            continue
        req = Request(rid, owner=f"u{k}", num_gpu=1 if milli == 1000 else 0, gpu_milli=milli % 1000)
        try:
            alloc.place(req)
        except Exception as e:  # refused: nothing held
            assert type(e).__name__ in ("NoCapacity", "AlreadyAllocated"), e
            continue
    held: dict[str, list[int]] = {}
    for p in alloc.allocations():
        for share in p.gpus:
            held.setdefault(share.uuid, []).append(share.milli)
            gpu = devices[share.uuid]
            if p.request.gpu_milli:
                assert share.milli == gpu.take_milli(p.request.gpu_milli) > 0
            else:
                assert gpu.capacity_milli == 1000 and share.milli == 1000
    for uuid, shares in held.items():
        gpu = devices[uuid]
        assert sum(shares) <= gpu.capacity_milli
        if gpu.share_step_milli == gpu.capacity_milli:
            assert len(shares) == 1  # a MIG instance or replica holds one share


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_share_takes_the_smallest_free_slice_that_holds_it(policy: str) -> None:
    layout = {"3g.40gb": (1, 500), "2g.20gb": (1, 250), "1g.10gb": (1, 125)}
    alloc = Allocator(Inventory([mig_node(layout=layout)]), policy=policy)
    first = alloc.place(Request("a/", owner="a", gpu_milli=250)).gpus[0]
    assert first.uuid == "mig/mig-2g.20gb-0" and first.milli == 250
    second = alloc.place(Request("b/", owner="b", gpu_milli=250)).gpus[0]
    assert second.uuid == "mig/mig-3g.40gb-0" and second.milli == 500  # the next that holds it
