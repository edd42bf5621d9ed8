"""Domain model: GPUs, nodes, the inventory, requests and placements (immutable values)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from .errors import InvalidRequest

#: Milli-GPU units in one whole GPU. Every GPU amount in the allocator is an exact int of milli.
MILLI = 1000

#: Label holding a node's rack; requests sharing an ``affinity_group`` prefer one rack.
RACK_LABEL = "gpulab.io/rack"
#: Standard Kubernetes zone label (informational; used as a fallback locality key).
ZONE_LABEL = "topology.kubernetes.io/zone"

Priority = Literal["on-demand", "preemptible"]
PRIORITIES: frozenset[str] = frozenset({"on-demand", "preemptible"})


@dataclass(frozen=True)
class GPU:
    """One device a share can be placed on: a GPU, or a part of one that the cluster hands out
    on its own (a MIG instance, a time-slicing replica). ``nvlink_group`` names the set of GPUs
    of its node joined by NVLink.

    ``capacity_milli`` is what the device holds, in milli of a whole GPU: 1000 for a GPU, less
    for a part (a 2g.20gb MIG instance of an 80 GB GPU: 250). Only a device of 1000 serves
    whole-GPU requests. ``share_step_milli`` is how fractions are cut from it: 1 (any fraction;
    gpulab enforces it), a coarser step that a share is rounded up to (HAMi with 10 splits per
    GPU: 100, so no more than 10 shares land on it), its capacity (a MIG instance or replica
    holds one share, whatever its size) or 0 (no fractions: a GPU the cluster offers whole
    only). A share holds what was taken, rounded; quotas count what was asked.
    """

    uuid: str
    model: str
    memory_mib: int = 0
    index: int = 0
    mig_capable: bool = False
    nvlink_group: str | None = None
    capacity_milli: int = MILLI
    share_step_milli: int = 1
    #: the MIG profile of a MIG instance ("2g.20gb"), else None
    mig_profile: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.capacity_milli <= MILLI:
            raise ValueError(
                f"GPU {self.uuid!r}: capacity_milli must be 1..{MILLI}, got {self.capacity_milli}"
            )
        if not 0 <= self.share_step_milli <= self.capacity_milli:
            raise ValueError(
                f"GPU {self.uuid!r}: share_step_milli must be 0..capacity_milli "
                f"({self.capacity_milli}), got {self.share_step_milli}"
            )

    def take_milli(self, milli: int) -> int:
        """What a fractional share of ``milli`` takes on this device; 0 when none can."""
        return share_taken(milli, self.share_step_milli, self.capacity_milli)


def share_taken(milli: int, step: int, capacity: int) -> int:
    """``milli`` rounded up to a multiple of ``step``; 0 when the device takes no fraction or
    the rounded share exceeds its capacity."""
    if step <= 1:
        return milli if 0 < milli <= capacity and step == 1 else 0
    taken = -(-milli // step) * step
    return taken if taken <= capacity else 0


@dataclass(frozen=True)
class Node:
    """A machine: CPU in milli-cores, memory in MiB, its GPUs and labels (zone, rack, ...)."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GPU, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise ValueError(f"Node {self.name!r}: cpu_milli and memory_mib must be >= 0")
        object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def rack(self) -> str | None:
        """The node's rack label, or None."""
        return self.labels.get(RACK_LABEL)


class Inventory:
    """The set of nodes the allocator places onto. Node names and GPU uuids must be unique."""

    def __init__(self, nodes: Iterable[Node]) -> None:
        self.nodes: tuple[Node, ...] = tuple(nodes)
        names: set[str] = set()
        uuids: set[str] = set()
        for node in self.nodes:
            if node.name in names:
                raise ValueError(f"Inventory: node name {node.name!r} appears twice")
            names.add(node.name)
            for gpu in node.gpus:
                if gpu.uuid in uuids:
                    raise ValueError(f"Inventory: GPU uuid {gpu.uuid!r} appears twice")
                uuids.add(gpu.uuid)
        self.total_gpu_milli: int = sum(g.capacity_milli for n in self.nodes for g in n.gpus)
        self.models: frozenset[str] = frozenset(g.model for n in self.nodes for g in n.gpus)
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def index_of(self, node_name: str) -> int | None:
        """Position of a node by name, or None if it is not in the inventory."""
        return self._index.get(node_name)

    @property
    def total_gpus(self) -> int:
        """Number of physical GPUs."""
        return self.total_gpu_milli // MILLI

    @classmethod
    def from_openb_csv(cls, path: object) -> Inventory:
        """Load the openb trace's node list (``sn,cpu_milli,memory_mib,gpu,model``)."""
        from .openb import load_openb_nodes

        return cls(load_openb_nodes(path))


@dataclass(frozen=True)
class Request:
    """What a server, job or worker asks for.

    ``num_gpu`` whole GPUs on one node, or ``gpu_milli`` (1..999) of one GPU, never both.
    ``gpu_models`` restricts the GPU model (empty = any). ``affinity_group`` makes related
    requests (a Dask cluster and its notebook) prefer the rack where the group already runs.

    ``preferred_node`` and ``preferred_nvlink_group`` are soft orderings, never constraints
    (decision 0003, "Placement next to the notebook"): the request goes to the preferred node
    when it fits there, else to a node of that node's rack, else where ``affinity_group`` runs,
    else anywhere; on the preferred node, GPUs of ``preferred_nvlink_group`` come first. A full
    or unknown preferred node is passed over, never a reason to refuse.
    """

    id: str
    owner: str = ""
    groups: frozenset[str] = frozenset()
    cpu_milli: int = 0
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_models: frozenset[str] = frozenset()
    priority: Priority = "on-demand"
    nvlink: bool = False
    affinity_group: str | None = None
    preferred_node: str | None = None
    preferred_nvlink_group: str | None = None
    #: what the share is for, as the GPU-hour ledger and the admin panel report it: the profile's
    #: slug and the kind of workload ("server", "job", "dask"); neither changes where it goes
    profile: str | None = None
    workload: str | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise InvalidRequest("A request needs a non-empty id (e.g. 'alice/gpu-server').")
        for name in ("gpu_models", "groups"):
            raw = getattr(self, name)
            if isinstance(raw, str | bytes):  # frozenset("A100") would be {"A", "1", "0"}
                raise InvalidRequest(
                    f"Request {self.id!r}: {name} must be a set of names, not the string "
                    f"{raw!r}; write frozenset({{{raw!r}}})."
                )
            try:
                values = frozenset(raw)
            except TypeError:  # None, a number, unhashable items
                raise InvalidRequest(
                    f"Request {self.id!r}: {name} must be a set of names, got {raw!r:.80}."
                ) from None
            if not all(isinstance(v, str) and v for v in values):
                raise InvalidRequest(
                    f"Request {self.id!r}: {name} must hold non-empty strings, got {raw!r}."
                )
            object.__setattr__(self, name, values)
        for name in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequest(
                    f"Request {self.id!r}: {name} must be an integer >= 0, got {value!r}."
                )
        if self.num_gpu and self.gpu_milli:
            raise InvalidRequest(
                f"Request {self.id!r}: ask for num_gpu whole GPUs or gpu_milli of one GPU, "
                f"not both "
                f"(got num_gpu={self.num_gpu}, gpu_milli={self.gpu_milli})."
            )
        if self.gpu_milli >= MILLI:
            raise InvalidRequest(
                f"Request {self.id!r}: gpu_milli={self.gpu_milli} is a whole GPU or more; "
                f"use num_gpu={self.gpu_milli // MILLI} for whole GPUs."
            )
        for name in ("preferred_node", "preferred_nvlink_group", "profile", "workload"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequest(
                    f"Request {self.id!r}: {name} must be a non-empty name or None, "
                    f"got {value!r:.80}."
                )
        if self.preferred_nvlink_group is not None and self.preferred_node is None:
            raise InvalidRequest(
                f"Request {self.id!r}: preferred_nvlink_group="
                f"{self.preferred_nvlink_group!r} names a group on the preferred node; "
                f"give preferred_node too."
            )
        if self.priority not in PRIORITIES:
            raise InvalidRequest(
                f"Request {self.id!r}: priority must be 'on-demand' or 'preemptible', "
                f"got {self.priority!r}."
            )

    @property
    def total_gpu_milli(self) -> int:
        """GPU amount in milli-GPU: ``num_gpu * 1000 + gpu_milli``."""
        return self.num_gpu * MILLI + self.gpu_milli

    @property
    def preemptible(self) -> bool:
        """True for preemptible (spot) requests."""
        return self.priority == "preemptible"

    @property
    def shape(self) -> tuple[int, int, int, int, frozenset[str], bool]:
        """The resource shape, independent of id/owner (equal shapes are interchangeable)."""
        return (
            self.cpu_milli,
            self.memory_mib,
            self.num_gpu,
            self.gpu_milli,
            self.gpu_models,
            self.nvlink and self.num_gpu > 1,
        )


@dataclass(frozen=True)
class GpuShare:
    """A share of one GPU held by a placement; ``milli == 1000`` is the whole GPU."""

    uuid: str
    milli: int


@dataclass(frozen=True)
class Placement:
    """Where a request went. ``over_quota`` marks preemptible work admitted beyond its budget."""

    request: Request
    node: str
    gpus: tuple[GpuShare, ...]
    created_at: float
    over_quota: bool = False

    @property
    def id(self) -> str:
        """The request id."""
        return self.request.id

    @property
    def gpu_milli(self) -> int:
        """Total GPU milli held."""
        return sum(s.milli for s in self.gpus)
