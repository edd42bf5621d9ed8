"""GPU allocator: placement, quotas, headroom and preemption over a GPU inventory.

Pure Python (no JupyterHub or Kubernetes imports); used by the local and Kubernetes spawners.

API::

    from gpulab.hub.allocator import Allocator, Inventory, Request, Quota

    inv = Inventory.from_openb_csv("openb_node_list_gpu_node.csv")   # or Inventory([Node(...)])
    alloc = Allocator.open(inv, "sqlite:///gpulab-allocations.sqlite", policy="best-fit",
                           headroom_fraction=0.15, quota=Quota(users={"alice": 2000}))
    p = alloc.place(Request("alice/gpu", owner="alice", gpu_milli=250))   # a quarter of a GPU
    alloc.capacity(Request("x", num_gpu=1, gpu_models=frozenset({"A100"})))  # copies that fit
    victims = alloc.propose_preemption(req)        # cheapest preemptible set, [] if it fits
    p, released = alloc.preempt_and_place(req)     # atomic
    alloc.release("alice/gpu")                     # idempotent

All GPU amounts are exact ints of milli-GPU (1000 = one GPU). See README.md beside this file.
"""

from .allocator import DEFAULT_POLICY, UNBOUNDED, Allocator, StaleAllocation
from .errors import (
    AllocationError,
    AlreadyAllocated,
    InvalidQuota,
    InvalidRequest,
    NoCapacity,
    QuotaExceeded,
    StaleAllocations,
)
from .model import (
    GPU,
    MILLI,
    RACK_LABEL,
    ZONE_LABEL,
    GpuShare,
    Inventory,
    Node,
    Placement,
    Priority,
    Request,
)
from .policies import POLICIES, Policy, get_policy
from .quota import Quota
from .store import AllocationStore, MemoryStore, SQLiteStore

__all__ = [
    "DEFAULT_POLICY",
    "GPU",
    "MILLI",
    "POLICIES",
    "RACK_LABEL",
    "UNBOUNDED",
    "ZONE_LABEL",
    "AllocationError",
    "AllocationStore",
    "Allocator",
    "AlreadyAllocated",
    "GpuShare",
    "InvalidQuota",
    "InvalidRequest",
    "Inventory",
    "MemoryStore",
    "NoCapacity",
    "Node",
    "Placement",
    "Policy",
    "Priority",
    "Quota",
    "QuotaExceeded",
    "Request",
    "SQLiteStore",
    "StaleAllocation",
    "StaleAllocations",
    "get_policy",
]
