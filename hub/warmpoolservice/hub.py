"""`GPUWarmPool`: warm pools (gpulab.hub.warmpool's plan) run in the hub.

Each member is a server of one profile started before anyone asked for it: its GPU share is a
preemptible reservation of the pool's own account (`WARM_POOL_OWNER`), so any real user's or
job's on-demand request takes the GPU first (the pool's evictor stops the member), and its
GPU-hours are the ledger's overhead (workload "warm"), never a person's. What a member is and how
it becomes a user's server is the backend's (the spawner class's `warm_pool_backend`: on the
embedded default a pre-imported server process that drops to the user's account at claim).

A claim takes the oldest ready member of the profile; the spawner then hands its reservation over
to the user's own request in one allocator step (`GPUCapacity.hand_over`: quota and budget
checked as for any start) and binds the process to her. A claim that cannot complete discards the
member and the start goes cold, so a claim never serves anything but a fresh member to one user.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from typing import Any, Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from traitlets import Float, List, Unicode, validate
from traitlets.config import SingletonConfigurable

from gpulab.hub.allocator import AllocationError, Placement
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.capacity_catalog import profile_milli
from gpulab.hub.hub_service import cancel_and_wait, hub_started
from gpulab.hub.profiles import Profile
from gpulab.hub.prometheus import register_collector
from gpulab.hub.warmpool import (
    WARM_POOL_OWNER,
    Member,
    PoolConfigError,
    PoolSpec,
    is_pool_allocation,
    member_allocation_id,
    parse_pools,
    plan,
)


class WarmStartFailed(Exception):
    """A member could not be started or bound; the message says why."""


class WarmMemberHandle(Protocol):
    """One pre-started server, as a backend made it."""

    id: str  # its reservation's allocation id
    profile: str
    fingerprint: str
    started_at: float

    @property
    def ready(self) -> bool: ...

    @property
    def alive(self) -> bool: ...

    async def wait_ready(self, timeout: float) -> None:
        """Return once the member is ready to be claimed; WarmStartFailed otherwise."""

    async def discard(self) -> None:
        """Stop it (nothing of it runs on return)."""


class WarmBackend(Protocol):
    def fingerprint(self, profile: Profile) -> str:
        """What a member of `profile` is made from (profile, command, image): a member of
        another fingerprint is stale and replaced."""

    async def start_member(
        self, member_id: str, profile: Profile, placement: Placement
    ) -> WarmMemberHandle: ...


@runtime_checkable
class SweepsMembers(Protocol):
    """A backend whose members outlive the hub process (Kubernetes pods): optional capability."""

    async def sweep_members(self, keep: set[str]) -> list[str]:
        """Stop every member not in `keep` (allocation ids) a previous hub left; the allocation
        ids they held."""


@runtime_checkable
class KeepsWarmServers(Protocol):
    """A spawner class that can keep pre-started servers (optional capability)."""

    @classmethod
    def warm_pool_backend(cls, *, config: Any, log: Any) -> WarmBackend: ...


class GPUWarmPool(SingletonConfigurable):
    """Pre-started servers per profile, claimed by the next user who starts that profile."""

    pools: List[Any] = List(
        config=True,
        help="""The warm pools: a list of {"profile": "<slug>", "min": 2, "max": 6,
        "schedule": "mon-fri 08:00-19:00"}. While its schedule is on (omitted or "always":
        always; several windows separated by ';'; days mon..sun; an end before the start runs
        past midnight; times in `timezone`) a pool keeps `min` members ready and grows by one
        per claim in the last `demand_window_seconds`, up to `max` members. Each member holds
        its profile's GPU share as a preemptible reservation of the pool's own account: any
        user's or job's on-demand start takes that GPU first. A mistake (unknown profile, max
        below min) stops the hub at start, naming the entry.""",
    )
    gpu_quota = Float(
        None,
        allow_none=True,
        config=True,
        help="""The most GPUs all warm pool members together may hold (the pool's system quota;
        fractions count exactly: four 1/4-GPU members hold 1). None: only each pool's max
        limits them. Their GPU-hours are the ledger's overhead account ('gpulab:warm-pool').""",
    )
    timezone = Unicode(
        "UTC",
        config=True,
        help="The IANA time zone the pools' schedules are written in (e.g. 'Europe/Berlin').",
    )
    demand_window_seconds = Float(
        600.0,
        config=True,
        help="""How far back claims count as demand: each claim in this window asks its pool for
        one more member (up to max), so a burst of logins is met by a larger pool.""",
    )
    check_interval_seconds = Float(
        5.0,
        config=True,
        help="""How often the pools are checked against what they want (also right after every
        claim): members that died are replaced, stale ones (profile or command changed) are
        recreated, surplus ones stopped.""",
    )
    member_start_timeout_seconds = Float(
        120.0,
        config=True,
        help="How long a member may take to become ready before it is counted failed.",
    )

    @validate("timezone")
    def _check_timezone(self, proposal: Any) -> str:
        try:
            ZoneInfo(str(proposal["value"]))
        except (ZoneInfoNotFoundError, ValueError):
            raise PoolConfigError(
                "GPUWarmPool.timezone", f"{proposal['value']!r} is not an IANA time zone"
            ) from None
        return str(proposal["value"])

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.specs: list[PoolSpec] = []
        self.members: dict[str, WarmMemberHandle] = {}
        self.unavailable = ""
        self._backend: WarmBackend | None = None
        self._capacity: GPUCapacity | None = None
        self._serial = 0
        self._claims: dict[str, deque[float]] = {}
        self.claimed_total: Counter[str] = Counter()
        self.failed_total: Counter[str] = Counter()
        self.desired: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._starting: set[asyncio.Task[None]] = set()
        #: reservations placed for members not yet started (kept by the reconciliation too)
        self._reserving: set[str] = set()

    # -- configuration -------------------------------------------------------------------------

    def load_pools(self, capacity: GPUCapacity) -> list[PoolSpec]:
        """Check `pools` against the catalog (PoolConfigError naming the entry)."""
        self.specs = parse_pools(self.pools, [p.slug for p in capacity.catalog])
        return self.specs

    def attach_to_hub(self, app: Any) -> None:
        """Start keeping the pools once the hub has started (called while it initialises)."""
        capacity = GPUCapacity.instance(config=self.config, log=self.log)
        if not self.specs:
            self.load_pools(capacity)
        if not self.specs:
            return
        if not isinstance(app.spawner_class, KeepsWarmServers):
            self.unavailable = f"{app.spawner_class.__name__} keeps no warm servers"
            self.log.warning("Warm pools are configured, but %s", self.unavailable)
            return
        self.attach(capacity, app.spawner_class.warm_pool_backend(config=self.config, log=self.log))
        self._task = asyncio.ensure_future(self._run(app))

    def attach(self, capacity: GPUCapacity, backend: WarmBackend) -> None:
        """Use `capacity` and `backend` (the hub does it in attach_to_hub; tests directly)."""
        self._capacity, self._backend = capacity, backend
        # the members' reservations belong to no server: the start-up reconciliation keeps them
        capacity.keep_allocations(lambda: set(self.members) | self._reserving)
        # any on-demand start may take a member's GPU: it stops the member
        capacity.add_evictor(is_pool_allocation, self._evict)
        register_collector("warm_pool", _PoolCollector(self))

    async def close(self) -> None:
        """Stop checking and stop every member (their reservations are released)."""
        await cancel_and_wait(self._task)
        self._task = None
        for task in list(self._starting):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._starting, return_exceptions=True)
        for member_id in list(self.members):
            await self._drop(member_id, "released")

    # -- claims --------------------------------------------------------------------------------

    def ready_count(self, slug: str) -> int:
        return sum(1 for m in self.members.values() if m.profile == slug and m.ready and m.alive)

    def claim(self, slug: str) -> WarmMemberHandle | None:
        """The oldest ready member of `slug`, now the caller's (no longer the pool's: the caller
        hands its reservation over, or discards it), or None: start cold."""
        fingerprint = self._fingerprint(slug)
        candidates = sorted(
            (
                m
                for m in self.members.values()
                if m.profile == slug and m.ready and m.alive and m.fingerprint == fingerprint
            ),
            key=lambda m: m.started_at,
        )
        if not candidates:
            return None
        member = candidates[0]
        del self.members[member.id]
        self._claims.setdefault(slug, deque()).append(time.monotonic())
        self.claimed_total[slug] += 1
        self._wake.set()
        return member

    async def discard(self, member: WarmMemberHandle, reason: str = "released") -> None:
        """A claimed member that will not serve (its claim failed): stopped, its reservation
        released if it still holds it."""
        with contextlib.suppress(Exception):
            await member.discard()
        if self._capacity is not None:
            await self._capacity.release(member.id, reason)
        self._wake.set()

    # -- keeping the pools ---------------------------------------------------------------------

    async def _run(self, app: Any) -> None:
        await hub_started(app)
        capacity = self._capacity
        assert capacity is not None
        await capacity.ready()
        await self.sweep()
        while True:
            self._wake.clear()
            try:
                await self.refill()
            except Exception:  # a pass that failed is tried again, not the end of the pools
                self.log.exception("Warm pool pass failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.check_interval_seconds)

    async def sweep(self) -> list[str]:
        """Release reservations of members a previous hub process left (on the embedded default
        its members ended with it: they exit when the hub's end of their control channel closes;
        a backend whose members outlive the hub, `SweepsMembers`, stops them first)."""
        capacity = self._capacity
        assert capacity is not None
        backend = self._backend
        if isinstance(backend, SweepsMembers):
            keep = set(self.members) | self._reserving
            try:
                swept = await backend.sweep_members(keep)
            except Exception:
                self.log.exception("Warm pool: could not sweep members a previous hub left")
            else:
                if swept:
                    self.log.info("Warm pool: stopped %d members a previous hub left", len(swept))
        left = [
            p.request.id
            for p in capacity.allocator.allocations()
            if is_pool_allocation(p.request.id) and p.request.id not in self.members
        ]
        for allocation_id in left:
            await capacity.release(allocation_id, "released")
        return left

    def _now(self) -> datetime:
        return datetime.now(ZoneInfo(self.timezone))

    def _fingerprint(self, slug: str) -> str:
        capacity, backend = self._capacity, self._backend
        profile = capacity.profile(slug) if capacity else None
        return backend.fingerprint(profile) if backend and profile else ""

    def _recent_claims(self, slug: str) -> int:
        claims = self._claims.get(slug)
        if not claims:
            return 0
        horizon = time.monotonic() - self.demand_window_seconds
        while claims and claims[0] < horizon:
            claims.popleft()
        return len(claims)

    def _held_milli(self) -> int:
        capacity = self._capacity
        assert capacity is not None
        return sum(
            sum(s.milli for s in p.gpus)
            for p in capacity.allocator.allocations()
            if is_pool_allocation(p.request.id)
        )

    async def refill(self) -> None:
        """One pass: replace dead members, recreate stale ones, stop surplus, start missing."""
        capacity, backend = self._capacity, self._backend
        assert capacity is not None and backend is not None
        for member in [m for m in self.members.values() if not m.alive]:
            self.log.warning("Warm pool member %s ended by itself; replacing it", member.id)
            self.failed_total[member.profile] += 1
            await self._drop(member.id, "released")
        now = self._now()
        for spec in self.specs:
            profile = capacity.profile(spec.profile)
            if profile is None:
                continue
            desired = spec.desired(now, self._recent_claims(spec.profile))
            self.desired[spec.profile] = desired
            fingerprint = backend.fingerprint(profile)
            members = [
                Member(m.id, m.profile, m.fingerprint, m.ready, m.started_at)
                for m in self.members.values()
                if m.profile == spec.profile
            ]
            decided = plan(desired, members, fingerprint)
            for member_id in decided.stop:
                self.log.info(
                    "Warm pool: stopping %s (%s)", member_id, decided.reasons.get(member_id)
                )
                await self._drop(member_id, "released")
            for _ in range(decided.start):
                if not await self._start_one(profile, fingerprint):
                    break

    async def _start_one(self, profile: Profile, fingerprint: str) -> bool:
        """Reserve a share and start a member on it; False when nothing more can be reserved."""
        capacity, backend = self._capacity, self._backend
        assert capacity is not None and backend is not None
        if self.gpu_quota is not None:
            limit = round(self.gpu_quota * 1000)
            if self._held_milli() + profile_milli(profile) > limit:
                return False
        self._serial += 1
        member_id = member_allocation_id(profile.slug, self._serial)
        request = capacity.request_for(
            profile,
            allocation_id=member_id,
            owner=WARM_POOL_OWNER,
            groups=frozenset(),
            workload="warm",
        )
        # preemptible: a member never keeps a GPU from anyone's on-demand start
        request = replace(request, priority="preemptible")
        self._reserving.add(member_id)
        try:
            try:
                placement = await asyncio.to_thread(capacity.allocator.place, request)
            except AllocationError as e:
                self.log.debug("Warm pool: no reservation for %s now: %s", profile.slug, e)
                return False
            try:
                member = await backend.start_member(member_id, profile, placement)
            except Exception as e:
                self.log.error("Warm pool: member %s did not start: %s", member_id, e)
                self.failed_total[profile.slug] += 1
                await capacity.release(member_id, "released")
                return False
            self.members[member_id] = member
        finally:
            self._reserving.discard(member_id)
        task = asyncio.ensure_future(self._await_ready(member))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)
        return True

    async def _await_ready(self, member: WarmMemberHandle) -> None:
        try:
            await member.wait_ready(self.member_start_timeout_seconds)
        except WarmStartFailed as e:
            self.log.error("Warm pool member %s failed: %s", member.id, e)
            self.failed_total[member.profile] += 1
            await self._drop(member.id, "released")
            return
        self.log.info("Warm pool member %s is ready", member.id)

    async def _drop(self, member_id: str, reason: str) -> None:
        member = self.members.pop(member_id, None)
        if member is not None:
            with contextlib.suppress(Exception):
                await member.discard()
        if self._capacity is not None:
            await self._capacity.release(member_id, reason)

    async def _evict(self, victim: Placement, reason: str) -> None:
        """An on-demand start took this member's GPU (the allocator released it already)."""
        member = self.members.pop(victim.request.id, None)
        self.log.info("Warm pool member %s gives its GPU back: %s", victim.request.id, reason)
        if member is not None:
            await member.discard()
        self._wake.set()


class _PoolCollector(Collector):
    """gpulab_warm_pool_{desired,ready,claimed_total,failed_total} per profile."""

    def __init__(self, pool: GPUWarmPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self.pool
        slugs = [s.profile for s in pool.specs]
        desired = GaugeMetricFamily(
            "gpulab_warm_pool_desired", "Members each warm pool wants now.", labels=["profile"]
        )
        ready = GaugeMetricFamily(
            "gpulab_warm_pool_ready", "Members ready to be claimed.", labels=["profile"]
        )
        claimed = CounterMetricFamily(
            "gpulab_warm_pool_claimed",
            "Starts served by a warm pool member since the hub started.",
            labels=["profile"],
        )
        failed = CounterMetricFamily(
            "gpulab_warm_pool_failed",
            "Members that failed to start or died before a claim, since the hub started.",
            labels=["profile"],
        )
        for slug in slugs:
            desired.add_metric([slug], pool.desired.get(slug, 0))
            ready.add_metric([slug], pool.ready_count(slug))
            claimed.add_metric([slug], pool.claimed_total[slug])
            failed.add_metric([slug], pool.failed_total[slug])
        yield from (desired, ready, claimed, failed)
