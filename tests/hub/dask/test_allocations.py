"""Allocation ids and allocator requests of schedulers and workers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.allocator import GPU, RACK_LABEL, Allocator, GpuShare, Inventory, Node, Request
from gpulab.hub.dask import (
    DaskAllocation,
    NearNotebook,
    near_notebook,
    parse_allocation_id,
    scheduler_allocation_id,
    scheduler_request,
    uses_dask_cuda,
    worker_allocation_id,
    worker_name,
    worker_request,
)
from gpulab.hub.jobs import PlacementSummary

owners = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)


@given(owner=owners, cluster_id=st.integers(1, 10**12), number=st.integers(1, 10**6))
def test_an_allocation_id_names_its_owner_cluster_and_worker_and_nothing_else(
    owner, cluster_id, number
):
    worker = worker_allocation_id(owner, cluster_id, number)
    assert parse_allocation_id(worker) == DaskAllocation(owner, cluster_id, number)
    scheduler = scheduler_allocation_id(owner, cluster_id)
    assert parse_allocation_id(scheduler) == DaskAllocation(owner, cluster_id, None)


def test_allocations_of_servers_and_jobs_are_not_a_cluster_s():
    for other in ("alice/", "alice/gpu", "alice/job-12", "alice/dask-x-w1", "alice/dask-1-w"):
        assert parse_allocation_id(other) is None


def test_a_worker_request_is_the_profile_s_under_the_worker_s_id():
    base = Request("probe", owner="", cpu_milli=4000, memory_mib=16_384, gpu_milli=250)
    request = worker_request(
        base, owner="alice", cluster_id=7, number=3, preemptible=False, affinity_group="alice"
    )
    assert (request.id, request.owner, request.affinity_group) == (
        "alice/dask-7-w3",
        "alice",
        "alice",
    )
    assert request.shape == base.shape and request.priority == "on-demand"
    spot = worker_request(
        base, owner="alice", cluster_id=7, number=4, preemptible=True, affinity_group=None
    )
    assert spot.priority == "preemptible"
    assert worker_name(3) == "w3"


def test_the_scheduler_asks_for_cpu_and_memory_only():
    request = scheduler_request(
        "alice", frozenset({"students"}), 7, cpu_milli=1000, memory_mib=2048, affinity_group="alice"
    )
    assert request.id == "alice/dask-7-scheduler"
    assert request.total_gpu_milli == 0 and request.cpu_milli == 1000


def test_dask_cuda_runs_where_the_worker_holds_a_gpu_share():
    assert uses_dask_cuda(PlacementSummary("n1", (GpuShare("GPU-0", 250),)))
    assert not uses_dask_cuda(PlacementSummary("n1", ()))


def _inventory() -> Inventory:
    gpus = tuple(GPU(f"n1-{i}", "A100", index=i, nvlink_group="xy"[i // 2]) for i in range(4))
    return Inventory(
        [
            Node("n1", 64_000, 262_144, gpus, labels={RACK_LABEL: "r1"}),
            Node("n2", 64_000, 262_144, (GPU("n2-0", "A100"),), labels={RACK_LABEL: "r1"}),
            Node("n3", 64_000, 262_144, (GPU("n3-0", "A100"),), labels={RACK_LABEL: "r2"}),
        ]
    )


def test_the_notebook_s_node_and_nvlink_group_are_where_workers_prefer_to_go():
    inv = _inventory()
    notebook = PlacementSummary("n1", (GpuShare("n1-3", 500),))
    assert near_notebook(notebook, inv) == NearNotebook("n1", "y")
    assert near_notebook(PlacementSummary("n3", ()), inv) == NearNotebook("n3")  # CPU notebook
    assert near_notebook(PlacementSummary("gone", (GpuShare("g", 1000),)), inv) == NearNotebook(
        "gone"
    )
    assert near_notebook(None, inv) is None


def test_workers_land_next_to_the_notebook_then_spill_to_its_rack():
    inv = _inventory()
    alloc = Allocator(inv, policy="best-fit")
    notebook = alloc.place(
        Request(
            "alice/", owner="alice", gpu_milli=500, preferred_node="n1", preferred_nvlink_group="y"
        )
    )
    near = near_notebook(notebook, inv)
    base = Request("probe", owner="", cpu_milli=1000, memory_mib=1024, num_gpu=1)
    placed = []
    for number in range(1, 5):
        request = worker_request(
            base,
            owner="alice",
            cluster_id=7,
            number=number,
            preemptible=False,
            affinity_group="alice",
            near=near,
        )
        placed.append(alloc.place(request))
    # the notebook's group first (its other GPU), then its node, then its rack
    assert placed[0].gpus[0].uuid in {"n1-2", "n1-3"} - {notebook.gpus[0].uuid}
    assert {p.node for p in placed[1:3]} == {"n1"}
    assert {s.uuid for p in placed[1:3] for s in p.gpus} == {"n1-0", "n1-1"}
    assert placed[3].node == "n2"


def test_a_profile_cannot_steer_workers_away_from_the_notebook():
    base = Request("probe", num_gpu=1, preferred_node="elsewhere", preferred_nvlink_group="z")
    kw = {
        "owner": "alice",
        "cluster_id": 7,
        "number": 1,
        "preemptible": False,
        "affinity_group": None,
    }
    assert worker_request(base, **kw, near=NearNotebook("n1", "x")).preferred_node == "n1"
    unset = worker_request(base, **kw)
    assert (unset.preferred_node, unset.preferred_nvlink_group) == (None, None)
