"""How the hub's allocations are taken and given back, as `GPUCapacity` methods: placing a
request (evicting preemptible work of another owner when on-demand work needs the room),
handing a warm pool member's GPUs over, releasing, reconciling after a restart, and the events
and notices kept for the admin and the user.

Apart from `capacity.py` (the options, the inventory and the allocator's making), as the part
that changes allocations. A plain mixin, after SingletonConfigurable in `GPUCapacity`'s bases, so
that it adds no options and the config reference is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from gpulab.hub.allocator import Allocator, Inventory, NoCapacity, Placement, QuotaExceeded, Request

#: (placement, reason) -> returns once nothing of that allocation runs
Evict = Callable[[Placement, str], Awaitable[None]]


class CapacityAllocations:
    """The allocation calls of `GPUCapacity` (which sets what is declared here)."""

    allocator: Allocator
    inventory: Inventory
    log: logging.Logger | logging.LoggerAdapter[Any]
    hour_budget_check: Callable[[Request], str | None] | None
    _waiting: Counter[str]
    _release_event: asyncio.Event | None
    _events: dict[str, list[dict[str, Any]]]
    _notices: dict[str, list[str]]
    _other_owners: list[Callable[[], set[str]]]
    _evictors: list[tuple[Callable[[str], bool], Evict]]
    _end_reasons: dict[str, str]
    _reconciled: bool

    async def place(self, request: Request) -> Placement:
        """Place `request`; when an on-demand request does not fit, preemptible work of an owner
        that can give it back (`add_evictor`: job runs) is evicted to make room, and this returns
        once nothing of it runs (a share is never handed out while its last holder still uses
        it). Preemptible servers are evicted by their spawner (GPUKubeSpawner), not here."""
        if self.hour_budget_check is not None:
            budget_refusal = self.hour_budget_check(request)
            if budget_refusal is not None:
                raise QuotaExceeded(budget_refusal)
        refusal: NoCapacity | None = None
        try:
            return await asyncio.to_thread(self.allocator.place, request)
        except NoCapacity as e:
            if request.preemptible or not self._evictors:
                raise
            refusal = e
        try:
            placement, victims = await asyncio.to_thread(
                self.allocator.preempt_and_place, request, self._has_evictor
            )
        except NoCapacity:
            raise refusal from None  # its reason, not the preemption search's
        for victim in victims:
            await self.evict(victim, f"preempted for on-demand work {request.id}")
        return placement

    async def hand_over(self, held_id: str, request: Request) -> Placement:
        """Give `held_id`'s GPUs (a warm pool member's reservation) to `request`, checked as
        `place` checks a start (GPU-hour budget, quota); AllocationError otherwise, and the
        reservation is left as it was."""
        if self.hour_budget_check is not None:
            budget_refusal = self.hour_budget_check(request)
            if budget_refusal is not None:
                raise QuotaExceeded(budget_refusal)
        return await asyncio.to_thread(self.allocator.hand_over, held_id, request)

    def add_evictor(self, owns: Callable[[str], bool], evict: Evict) -> None:
        """Another owner of allocations (the job service) that can give a preemptible one back:
        `owns(allocation_id)` says which are its, `evict(placement, reason)` stops it and returns
        when nothing of it runs. The allocator has already released the victim's share."""
        self._evictors.append((owns, evict))

    def remove_evictor(self, evict: Evict) -> None:
        self._evictors = [(owns, e) for owns, e in self._evictors if e != evict]

    def has_evictor(self, placement: Placement) -> bool:
        """Whether another owner (the job or Dask service) can stop `placement`'s work."""
        return self._has_evictor(placement)

    def _has_evictor(self, placement: Placement) -> bool:
        return any(owns(placement.request.id) for owns, _ in self._evictors)

    async def evict(self, victim: Placement, reason: str) -> bool:
        """Evict `victim` through its owner's evictor; False when no evictor owns it."""
        for owns, evict in self._evictors:
            if owns(victim.request.id):
                self.record_event(victim.request.id, "preempted", reason)
                await evict(victim, reason)
                return True
        return False

    def note_end_reason(self, allocation_id: str, reason: str) -> None:
        """Why `allocation_id` is about to end, for when its holder releases it (a stop by the
        culler, a budget or an admin's preemption: the GPU-hour ledger records it)."""
        self._end_reasons[allocation_id] = reason

    async def release(self, allocation_id: str, reason: str | None = None) -> Placement | None:
        noted = self._end_reasons.pop(allocation_id, None)
        why = reason or noted or "released"
        placement = await asyncio.to_thread(self.allocator.release, allocation_id, why)
        if placement is not None and self._release_event is not None:
            event, self._release_event = self._release_event, None
            event.set()
        return placement

    async def wait_for_release(self, timeout: float) -> None:
        """Return when some allocation is released, or after `timeout` seconds."""
        if self._release_event is None:
            self._release_event = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._release_event.wait(), timeout)

    def waiting(self, slug: str) -> _WaitingTicket:
        return _WaitingTicket(self._waiting, slug)

    def keep_allocations(self, live: Callable[[], set[str]]) -> None:
        """Another owner of allocations (the job service): `live()` names those it holds now,
        which `reconcile` must keep although no server has them."""
        self._other_owners.append(live)

    def reconcile(self, live_allocation_ids: set[str]) -> list[Placement]:
        """Release allocations that belong to no server JupyterHub knows of and no other owner
        holds (the hub died between placing and recording a server). Runs once per hub process,
        before the first spawn."""
        if self._reconciled:
            return []
        self._reconciled = True
        live = set(live_allocation_ids)
        for other in self._other_owners:
            live |= other()
        orphans = [p for p in self.allocator.allocations() if p.request.id not in live]
        for p in orphans:
            self.allocator.release(p.request.id)
            self.log.warning("Released orphaned GPU allocation %s on %s", p.request.id, p.node)
        return orphans

    def record_event(self, allocation_id: str, stage: str, message: str) -> None:
        """Watchdog warnings and stops, kept (bounded) for the admin's allocation list."""
        events = self._events.setdefault(allocation_id, [])
        events.append({"time": time.time(), "stage": stage, "message": message})
        del events[:-20]

    def record_notice(self, user: str, message: str) -> None:
        """Something a user should read next time they open the picker (e.g. a preemption)."""
        notices = self._notices.setdefault(user, [])
        notices.append(message)
        del notices[:-5]

    def take_notices(self, user: str) -> list[str]:
        return self._notices.pop(user, [])

    def events_for(self, allocation_id: str) -> list[dict[str, Any]]:
        return list(self._events.get(allocation_id, []))

    def gpu_by_uuid(self, uuid: str) -> Any:
        for node in self.inventory.nodes:
            for gpu in node.gpus:
                if gpu.uuid == uuid:
                    return gpu
        raise KeyError(uuid)


class _WaitingTicket:
    """Counts a spawn as waiting for its profile while the `with` block runs."""

    def __init__(self, counter: Counter[str], slug: str) -> None:
        self._counter, self._slug = counter, slug

    def __enter__(self) -> None:
        self._counter[self._slug] += 1

    def __exit__(self, *exc: object) -> None:
        self._counter[self._slug] -= 1
