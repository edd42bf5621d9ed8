"""The allocator: place, release and preempt GPU requests over an inventory, atomically."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import AlreadyAllocated, InvalidRequest, NoCapacity, StaleAllocations
from .explain import explain_no_fit
from .model import MILLI, GpuShare, Inventory, Placement, Request
from .policies import Policy, get_policy
from .policies.base import ScoredPolicy
from .preemption import Victim, cheapest_on_node
from .quota import Quota, QuotaLedger
from .state import ClusterState, Shape
from .store import AllocationStore, MemoryStore, SQLiteStore
from .units import fmt_gpus

#: The policy used when none is named.
DEFAULT_POLICY = "gpulab"
#: What ``capacity`` returns for a request that asks for nothing.
UNBOUNDED = sys.maxsize

#: (every allocation held now, {id removed by this change: "released" | "preempted"})
Listener = Callable[[list[Placement], dict[str, str]], None]


@dataclass(frozen=True)
class StaleAllocation:
    """A persisted placement that no longer fits the inventory, and why."""

    placement: Placement
    reason: str


class Allocator:
    """Decides where GPU requests go; thread-safe; every change is persisted before returning.

    ``policy``: ``first-fit``, ``best-fit``, ``random`` or ``fgd`` (see ``policies.POLICIES``).
    ``headroom_fraction``: share of GPU capacity kept free for on-demand requests; preemptible
    requests are refused once they would eat into it. ``quota``: per-user/group budgets.
    ``store``: where allocations persist (default: memory only); persisted allocations are loaded
    at construction. Rows that no longer fit the inventory (node or GPU removed, smaller node)
    are not loaded; they are listed in ``stale`` (or raise StaleAllocations when ``strict``),
    stay in the store, and are deleted by ``release(id)``.
    """

    def __init__(
        self,
        inventory: Inventory,
        *,
        policy: str | Policy = DEFAULT_POLICY,
        headroom_fraction: float = 0.0,
        quota: Quota | None = None,
        store: AllocationStore | None = None,
        seed: int | None = None,
        strict: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0.0 <= headroom_fraction < 1.0:
            raise ValueError(f"headroom_fraction must be in [0, 1), got {headroom_fraction!r}")
        self.inventory = inventory
        self.policy = get_policy(policy, seed) if isinstance(policy, str) else policy
        self.headroom_milli = round(headroom_fraction * inventory.total_gpu_milli)
        self.quota = quota or Quota()
        self.store: AllocationStore = store if store is not None else MemoryStore()
        self.clock = clock
        self._lock = threading.RLock()
        self._listeners: list[Listener] = []
        self._state = ClusterState(inventory)
        self._ledger = QuotaLedger(self.quota)
        self._placements: dict[str, Placement] = {}
        self._held: dict[str, tuple[int, list[tuple[int, int]]]] = {}
        self._on_node: dict[int, set[str]] = {}
        self._affinity: dict[str, dict[str, int]] = {}
        self._rack_nodes: dict[str, list[int]] = {}
        for i, node in enumerate(inventory.nodes):
            if node.rack is not None:
                self._rack_nodes.setdefault(node.rack, []).append(i)
        self.stale: list[StaleAllocation] = []
        #: shape -> (free_epoch when it last failed, reason); valid until something is released
        self._failed: dict[tuple[object, ...], tuple[int, str]] = {}
        for placement in self.store.load():
            reason = self._adopt(placement)
            if reason is not None:
                self.stale.append(StaleAllocation(placement, reason))
        if strict and self.stale:
            lines = "; ".join(f"{s.placement.id}: {s.reason}" for s in self.stale)
            raise StaleAllocations(f"{len(self.stale)} stored allocation(s) no longer fit: {lines}")

    @classmethod
    def open(
        cls, inventory: Inventory, db_url: str = "sqlite:///gpulab-allocations.sqlite", **kw: object
    ) -> Allocator:
        """An allocator persisted in the SQLite database at ``db_url``; reloads its allocations."""
        return cls(inventory, store=SQLiteStore(db_url), **kw)  # type: ignore[arg-type]

    # -- queries ----------------------------------------------------------------------------

    def get(self, request_id: str) -> Placement | None:
        """The placement of ``request_id``, or None."""
        with self._lock:
            return self._placements.get(request_id)

    def allocations(self) -> list[Placement]:
        """Every live placement, oldest first."""
        with self._lock:
            return sorted(self._placements.values(), key=lambda p: (p.created_at, p.id))

    def usage_milli(self, owner: str) -> int:
        """Milli-GPU held by ``owner`` (all allocations, over-quota ones included)."""
        with self._lock:
            return self._ledger.user_total.get(owner, 0)

    def quota_left_milli(self, owner: str, groups: frozenset[str]) -> int | None:
        """Milli-GPU ``owner`` may still take (tightest user/group budget); None = unlimited."""
        with self._lock:
            return self._ledger.left(owner, frozenset(groups))

    @property
    def used_gpu_milli(self) -> int:
        """Milli-GPU allocated over the whole inventory."""
        return self._state.used_gpu_milli

    def capacity(self, request: Request) -> int:
        """How many more copies of ``request``'s shape fit now (ignores quota, honours headroom)."""
        with self._lock:
            state = self._state
            cpu, mem, num_gpu, milli, models, nvlink = request.shape
            count = 0
            unbounded = not (cpu or mem or num_gpu or milli)
            if unbounded:
                return UNBOUNDED
            for sid, group in state.groups.items():
                sig = state.sigs[sid]
                _, cpu_free, mem_free, gpus = sig
                cls = state.node_class(sig)
                allowed = [not models or m in models for m in cls.models]
                n = UNBOUNDED
                if cpu:
                    n = min(n, cpu_free // cpu)
                if mem:
                    n = min(n, mem_free // mem)
                if milli:
                    takes = [cls.take(p, milli) if allowed[p] else 0 for p in range(len(gpus))]
                    n = min(n, sum(f // t for f, t in zip(gpus, takes, strict=True) if t))
                elif num_gpu:
                    idle = [p for p, f in enumerate(gpus) if f == MILLI and allowed[p]]
                    if nvlink:
                        per: dict[str, int] = {}
                        for p in idle:
                            link = cls.nvlink[p]
                            if link is not None:
                                per[link] = per.get(link, 0) + 1
                        n = min(n, sum(c // num_gpu for c in per.values()))
                    else:
                        n = min(n, len(idle) // num_gpu)
                count += n * len(group)
            if request.preemptible and request.total_gpu_milli:
                room = self._preemptible_room()
                count = min(count, max(0, room) // request.total_gpu_milli)
            return count

    # -- changes ----------------------------------------------------------------------------

    def place(self, request: Request) -> Placement:
        """Place ``request`` (quota check, placement and persistence in one critical section).

        Raises InvalidRequest, AlreadyAllocated, QuotaExceeded or NoCapacity, each with a reason.
        """
        with self._lock:
            over_quota = self._admit(request)
            choice = self._choose(request)
            if choice is None:
                raise NoCapacity(self._failure_reason(request))
            node, option = choice
            placement = self._commit(request, node, option, over_quota, [])
            self._notify({})
            return placement

    def release(self, request_id: str, reason: str = "released") -> Placement | None:
        """Free ``request_id``'s resources; idempotent, None when it is not held. ``reason``
        is what listeners are told (the GPU-hour ledger's end reason: "released", "culled"...)."""
        with self._lock:
            placement = self._placements.get(request_id)
            if placement is None:
                stale = [s for s in self.stale if s.placement.id == request_id]
                if stale:
                    self.store.commit([], [request_id])
                    self.stale = [s for s in self.stale if s.placement.id != request_id]
                    return stale[0].placement
                return None
            self.store.commit([], [request_id])
            self._forget(request_id)
            self._notify({request_id: reason})
            return placement

    def hand_over(self, held_id: str, request: Request, reason: str = "handed-over") -> Placement:
        """Give the GPUs, node and room ``held_id`` holds to ``request`` in one persisted step:
        a warm pool member's reservation becoming the share of the user who claimed it. The
        request must have the same shape (the same profile); its owner's quota is checked as
        for ``place``. Listeners see ``held_id`` end with ``reason`` and ``request`` begin.

        Raises NoCapacity when ``held_id`` is not held (taken by preemption meanwhile),
        InvalidRequest when the shapes differ, AlreadyAllocated or QuotaExceeded as ``place``.
        """
        with self._lock:
            held = self._placements.get(held_id)
            if held is None:
                raise NoCapacity(f"{held_id!r} holds nothing to hand over (released meanwhile).")
            if held.request.shape != request.shape:
                raise InvalidRequest(
                    f"{request.id!r} asks for another shape than {held_id!r} holds; a hand-over "
                    "keeps the same GPUs, so it needs the same profile."
                )
            over_quota = self._admit(request)
            node, shares = self._held[held_id]
            placement = Placement(
                request=request,
                node=held.node,
                gpus=held.gpus,
                created_at=self.clock(),
                over_quota=over_quota,
            )
            self.store.commit([placement], [held_id])
            self._forget(held_id)
            self._state.apply(node, request.cpu_milli, request.memory_mib, shares, +1)
            self._remember(placement, node, shares)
            self._notify({held_id: reason})
            return placement

    def propose_preemption(
        self, request: Request, evictable: Callable[[Placement], bool] | None = None
    ) -> list[Placement]:
        """The cheapest set of preemptible placements whose release lets ``request`` fit.

        ``[]`` when it fits already. Raises NoCapacity when no set of preemptible victims is
        enough (on-demand work is never preempted, and preemptible requests preempt nothing),
        QuotaExceeded when the request is over its budget anyway. ``evictable``: only
        placements it accepts are candidates (the caller can evict only those).
        """
        with self._lock:
            self._admit(request)
            found = self._find_victims(request, evictable)
            return [] if found is None else [v.placement for v in found[1]]

    def preempt_and_place(
        self, request: Request, evictable: Callable[[Placement], bool] | None = None
    ) -> tuple[Placement, list[Placement]]:
        """Release the cheapest victims and place ``request`` in one atomic, persisted step
        (``evictable`` as for ``propose_preemption``)."""
        with self._lock:
            over_quota = self._admit(request)
            found = self._find_victims(request, evictable)
            if found is None:
                choice = self._choose(request)
                assert choice is not None
                placement = self._commit(request, choice[0], choice[1], over_quota, [])
                self._notify({})
                return placement, []
            node, victims = found
            state = self._state
            for v in victims:
                state.apply(v.node, v.cpu, v.mem, list(v.shares), -1)
            try:
                choice = self.policy.choose(state, request.shape, [node])
                assert choice is not None, "victims were chosen so that the request fits"
                placement = self._commit(
                    request, node, choice[1], over_quota, [v.placement for v in victims]
                )
            except BaseException:
                for v in victims:
                    state.apply(v.node, v.cpu, v.mem, list(v.shares), +1)
                raise
            for v in victims:
                self._forget(v.placement.id, resources=False)
            self._notify({v.placement.id: "preempted" for v in victims})
            return placement, [v.placement for v in victims]

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(allocations, removed)`` after every change, with every allocation
        held now and why each one removed by it went ({id: "released" | "preempted"}). It runs
        inside the allocator's lock, in order with the changes: it must be quick (the GPU-hour
        ledger queues the snapshot and writes it elsewhere) and must not call the allocator."""
        self._listeners.append(listener)

    def notify_listeners(self) -> None:
        """Call every listener with the allocations held now and nothing removed (a periodic
        reconciliation: in order with the changes, since it holds the same lock)."""
        with self._lock:
            self._notify({})

    def remove_listener(self, listener: Listener) -> None:
        self._listeners = [x for x in self._listeners if x is not listener]

    def _notify(self, removed: dict[str, str]) -> None:
        if self._listeners:
            held = list(self._placements.values())
            for listener in self._listeners:
                listener(held, removed)

    # -- internals --------------------------------------------------------------------------

    def _preemptible_room(self) -> int:
        return self.inventory.total_gpu_milli - self.headroom_milli - self._state.used_gpu_milli

    def _admit(self, request: Request) -> bool:
        if request.id in self._placements:
            raise AlreadyAllocated(
                f"{request.id!r} already holds an allocation on "
                f"{self._placements[request.id].node}; release it first."
            )
        if request.gpu_models and request.total_gpu_milli:
            missing = request.gpu_models - self.inventory.models
            if missing == request.gpu_models:
                have = ", ".join(sorted(self.inventory.models)) or "none"
                raise NoCapacity(
                    f"No GPU of model {'|'.join(sorted(request.gpu_models))} in this cluster "
                    f"(models here: {have})."
                )
        over = self._ledger.admit(request)
        milli = request.total_gpu_milli
        free = self.inventory.total_gpu_milli - self._state.used_gpu_milli
        if request.preemptible and milli > self._preemptible_room() and milli <= free:
            raise NoCapacity(
                f"Preemptible requests may not use the {fmt_gpus(self.headroom_milli)} kept for "
                f"on-demand servers ({fmt_gpus(max(0, self._preemptible_room()))} left for "
                f"preemptible work); ask for an on-demand server or try later."
            )
        return over

    def _choose(self, request: Request) -> tuple[int, tuple[int, ...]] | None:
        shape = request.shape
        if request.preferred_node is not None:
            choice = self._choose_near(request)
            if choice is not None:
                return choice
        racks = self._affinity.get(request.affinity_group or "")
        if racks:
            near: list[int] = [i for rack in sorted(racks) for i in self._rack_nodes.get(rack, [])]
            choice = self.policy.choose(self._state, shape, near)
            if choice is not None:
                return choice
        failed = self._failed.get(shape)
        if failed is not None and failed[0] == self._state.free_epoch:
            return None  # nothing was released since it last failed: it cannot fit now either
        return self.policy.choose(self._state, shape)

    def _choose_near(self, request: Request) -> tuple[int, tuple[int, ...]] | None:
        """The preferred node, else a node of its rack; None hands over to the usual order.

        Soft: a preferred node that is full, or not in the inventory (a notebook on a node
        without GPUs the allocator does not manage), only makes this return None.
        """
        assert request.preferred_node is not None
        node = self.inventory.index_of(request.preferred_node)
        if node is None:
            return None
        shape = request.shape
        failed = self._failed.get(shape)
        if failed is not None and failed[0] == self._state.free_epoch:
            return None  # fits nowhere, so neither here nor in the rack
        choice = self.policy.choose(self._state, shape, [node])
        if choice is not None:
            group = request.preferred_nvlink_group
            if group is not None:
                option = self._option_in_group(node, shape, group)
                if option is not None:
                    return node, option
            return choice
        rack = self.inventory.nodes[node].rack
        if rack is None:
            return None
        near = [i for i in self._rack_nodes.get(rack, []) if i != node]
        return self.policy.choose(self._state, shape, near) if near else None

    def _option_in_group(self, node: int, shape: Shape, group: str) -> tuple[int, ...] | None:
        """GPU positions on ``node`` for ``shape`` all in NVLink ``group`` (the policy's best
        among them), or None when the group cannot hold it; the node must fit ``shape``."""
        state = self._state
        sig = state.sig(node)
        cls = state.node_class(sig)
        if cls.interchangeable:
            return None  # its GPUs share one group (or none): the policy's choice is as good
        # A node that is not interchangeable keeps its GPUs in index order: positions are indices.
        _, _, num_gpu, milli, models, _ = shape
        options: list[tuple[int, ...]] = []
        if milli:
            seen: set[int] = set()
            for p in state.fitting_positions(sig, shape):
                if cls.nvlink[p] == group and p not in seen:
                    seen.add(p)
                    options.append((p,))
        elif num_gpu:
            per_model: dict[str, list[int]] = {}
            for p, free in enumerate(sig[3]):
                allowed = not models or cls.models[p] in models
                if free == MILLI and cls.nvlink[p] == group and allowed:
                    per_model.setdefault(cls.models[p], []).append(p)
            options = [tuple(ps[:num_gpu]) for ps in per_model.values() if len(ps) >= num_gpu]
        if not options:
            return None
        policy = self.policy
        if isinstance(policy, ScoredPolicy) and len(options) > 1:
            return min(options, key=lambda o: (policy.score(state, sig, shape, o), o))
        return options[0]

    def _failure_reason(self, request: Request) -> str:
        """Why ``request`` does not fit, remembered until resources are released again."""
        shape = request.shape
        epoch = self._state.free_epoch
        failed = self._failed.get(shape)
        if failed is not None and failed[0] == epoch:
            return failed[1]
        if len(self._failed) > 10_000:
            self._failed.clear()
        reason = explain_no_fit(self._state, request)
        self._failed[shape] = (epoch, reason)
        return reason

    def _commit(
        self,
        request: Request,
        node: int,
        option: tuple[int, ...],
        over_quota: bool,
        removed: list[Placement],
    ) -> Placement:
        state = self._state
        shape = request.shape
        shares = state.shares_for(node, shape, option)
        gpus = self.inventory.nodes[node].gpus
        placement = Placement(
            request=request,
            node=self.inventory.nodes[node].name,
            gpus=tuple(GpuShare(gpus[j].uuid, m) for j, m in shares),
            created_at=self.clock(),
            over_quota=over_quota,
        )
        if not state.can_apply(node, request.cpu_milli, request.memory_mib, iter(shares)):
            raise AssertionError("policy chose a placement that does not fit")
        self.store.commit([placement], [p.id for p in removed])
        for p in removed:
            self._ledger.add(p, -1)
        state.apply(node, request.cpu_milli, request.memory_mib, shares, +1)
        self._remember(placement, node, shares)
        self.policy.observe(request)
        return placement

    def _remember(self, placement: Placement, node: int, shares: list[tuple[int, int]]) -> None:
        rid = placement.id
        self._placements[rid] = placement
        self._held[rid] = (node, shares)
        self._on_node.setdefault(node, set()).add(rid)
        self._ledger.add(placement, +1)
        group = placement.request.affinity_group
        rack = self.inventory.nodes[node].rack
        if group is not None and rack is not None:
            racks = self._affinity.setdefault(group, {})
            racks[rack] = racks.get(rack, 0) + 1

    def _forget(self, rid: str, resources: bool = True) -> None:
        placement = self._placements.pop(rid)
        node, shares = self._held.pop(rid)
        self._on_node[node].discard(rid)
        if resources:
            req = placement.request
            self._state.apply(node, req.cpu_milli, req.memory_mib, shares, -1)
            self._ledger.add(placement, -1)
        group = placement.request.affinity_group
        rack = self.inventory.nodes[node].rack
        if group is not None and rack is not None:
            racks = self._affinity[group]
            racks[rack] -= 1
            if not racks[rack]:
                del racks[rack]
            if not racks:
                del self._affinity[group]

    def _adopt(self, placement: Placement) -> str | None:
        """Load a persisted placement into the state; the reason it does not fit, or None."""
        req = placement.request
        if placement.id in self._placements:
            return "duplicate id"
        node = self.inventory.index_of(placement.node)
        if node is None:
            return f"node {placement.node!r} is no longer in the inventory"
        shares: list[tuple[int, int]] = []
        gpus = self.inventory.nodes[node].gpus
        for share in placement.gpus:
            loc = self._state.uuid_loc.get(share.uuid)
            if loc is None or loc[0] != node:
                return f"GPU {share.uuid} is no longer on node {placement.node!r}"
            model = gpus[loc[1]].model
            if req.gpu_models and model not in req.gpu_models:
                return f"GPU {share.uuid} is now a {model}, not {'|'.join(sorted(req.gpu_models))}"
            if req.num_gpu and share.milli != MILLI:
                return f"GPU {share.uuid} holds a fraction of a whole-GPU request"
            if req.gpu_milli and share.milli != gpus[loc[1]].take_milli(req.gpu_milli):
                return f"GPU {share.uuid} no longer takes a share of that size as it was taken"
            shares.append((loc[1], share.milli))
        if req.num_gpu and sum(m for _, m in shares) != req.total_gpu_milli:
            return "stored GPU shares do not add up to the request"
        if req.gpu_milli and len(shares) != 1:
            return "a fractional request holds exactly one GPU share"
        if not self._state.can_apply(node, req.cpu_milli, req.memory_mib, iter(shares)):
            return f"node {placement.node!r} no longer has room for it (over-commit refused)"
        self._state.apply(node, req.cpu_milli, req.memory_mib, shares, +1)
        self._remember(placement, node, shares)
        return None

    def _find_victims(
        self, request: Request, evictable: Callable[[Placement], bool] | None = None
    ) -> tuple[int, tuple[Victim, ...]] | None:
        """None when the request fits now; else (node, victims); NoCapacity when impossible."""
        if self._choose(request) is not None:
            return None
        if request.preemptible:
            raise NoCapacity(
                self._failure_reason(request) + " Preemptible requests do not preempt others."
            )
        now = self.clock()
        shape = request.shape
        best: tuple[tuple[int, int, float], int, tuple[Victim, ...]] | None = None
        for node, rids in self._on_node.items():
            cands = []
            for rid in rids:
                p = self._placements[rid]
                if p.request.preemptible and (evictable is None or evictable(p)):
                    _, shares = self._held[rid]
                    cands.append(
                        Victim(p, node, p.request.cpu_milli, p.request.memory_mib, tuple(shares))
                    )
            cands.sort(key=lambda v: v.placement.id)
            found = cheapest_on_node(self._state, node, shape, cands, now)
            if found is not None and (best is None or (found[0], node) < (best[0], best[1])):
                best = (found[0], node, found[1])
        if best is None:
            raise NoCapacity(
                self._failure_reason(request) + " Preempting spot servers would not make room."
            )
        return best[1], best[2]


__all__ = ["DEFAULT_POLICY", "UNBOUNDED", "Allocator", "InvalidRequest", "StaleAllocation"]
