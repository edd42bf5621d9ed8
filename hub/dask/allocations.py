"""What a Dask cluster asks of the hub's allocator: the allocation ids of its scheduler and
workers (and their parse back), a worker's name, the requests, and the soft preference for the
notebook's node (decision record 0003).

Apart from ``model``: the one place where clusters meet the allocator's ``Request`` and
``Placement``, as ids a restarted hub (or the cluster view of an executor) reads back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..allocator import Inventory, Placement, Request
from ..jobs.model import PlacementSummary

_ALLOCATION = re.compile(
    r"(?P<owner>.+)/dask-(?P<cluster>[0-9]+)-(?P<part>scheduler|w[0-9]+)", re.DOTALL
)


def worker_allocation_id(owner: str, cluster_id: int, number: int) -> str:
    """``alice/dask-7-w3``: the allocation of worker 3 of cluster 7. Worker numbers are never
    reused within a cluster, so an id names one worker for good (after a hub restart too)."""
    return f"{owner}/dask-{cluster_id}-w{number}"


def scheduler_allocation_id(owner: str, cluster_id: int) -> str:
    """``alice/dask-7-scheduler``: the scheduler's allocation (CPU and memory, no GPU)."""
    return f"{owner}/dask-{cluster_id}-scheduler"


@dataclass(frozen=True)
class DaskAllocation:
    """What a Dask allocation id names: the owner, the cluster and the worker (None: the
    scheduler)."""

    owner: str
    cluster_id: int
    worker: int | None


def parse_allocation_id(allocation: str) -> DaskAllocation | None:
    """The parts of a Dask allocation id; None for any other allocation (a server's, a job's)."""
    match = _ALLOCATION.fullmatch(allocation)
    if match is None:
        return None
    part = match["part"]
    worker = None if part == "scheduler" else int(part[1:])
    return DaskAllocation(match["owner"], int(match["cluster"]), worker)


def worker_name(number: int) -> str:
    """The worker's name in its scheduler and dashboard (``w3``); the scheduler's
    ``workers_to_close(attribute="name")`` answers with these."""
    return f"w{number}"


@dataclass(frozen=True)
class NearNotebook:
    """Where a cluster's notebook runs, as the allocator's soft preference for its workers
    (decision 0003, "Placement next to the notebook"): its node, and the NVLink group of its
    first GPU on that node (None: no GPU, or GPUs without NVLink)."""

    node: str
    nvlink_group: str | None = None


def near_notebook(
    notebook: Placement | PlacementSummary | None, inventory: Inventory
) -> NearNotebook | None:
    """The preference for workers of a notebook placed at ``notebook`` (None: the notebook holds
    no allocation, so there is nothing to be near). A node or GPU the inventory no longer has
    still names the node: the allocator passes over a preferred node it does not know."""
    if notebook is None:
        return None
    index = inventory.index_of(notebook.node)
    if index is None or not notebook.gpus:
        return NearNotebook(notebook.node)
    groups = {gpu.uuid: gpu.nvlink_group for gpu in inventory.nodes[index].gpus}
    return NearNotebook(notebook.node, groups.get(notebook.gpus[0].uuid))


def worker_request(
    base: Request,
    *,
    owner: str,
    cluster_id: int,
    number: int,
    preemptible: bool,
    affinity_group: str | None,
    near: NearNotebook | None = None,
) -> Request:
    """The allocator request of one worker: the profile's request (``base``, from the hub's
    ``GPUCapacity.request_for``) under the worker's allocation id, with the notebook's affinity
    group so that workers land next to it where the allocator can, and preemptible when the
    cluster asked for it whatever the profile says.

    ``near`` (see ``near_notebook``) makes the notebook's node, then its rack, the first choice,
    and on that node the notebook's NVLink group; soft: a full node is passed over, never a
    refusal. A preference in ``base`` is replaced, so a profile cannot steer workers elsewhere.
    """
    return replace(
        base,
        id=worker_allocation_id(owner, cluster_id, number),
        owner=owner,
        priority="preemptible" if preemptible else base.priority,
        affinity_group=affinity_group,
        preferred_node=near.node if near is not None else None,
        preferred_nvlink_group=near.nvlink_group if near is not None else None,
    )


def scheduler_request(
    owner: str,
    groups: frozenset[str],
    cluster_id: int,
    *,
    cpu_milli: int,
    memory_mib: int,
    affinity_group: str | None,
) -> Request:
    """The scheduler's allocator request: CPU and memory only (it runs no GPU code), so that
    the allocator's CPU and memory accounting stays true; it counts against no GPU quota."""
    return Request(
        id=scheduler_allocation_id(owner, cluster_id),
        owner=owner,
        groups=groups,
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        affinity_group=affinity_group,
    )


def uses_dask_cuda(placement: Placement | PlacementSummary) -> bool:
    """Whether a worker on ``placement`` runs dask-cuda's worker (it holds a GPU share) or a
    plain ``distributed`` worker (a CPU-only profile)."""
    return bool(placement.gpus)
