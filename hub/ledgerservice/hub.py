"""The GPU-hour ledger inside a running hub: its options (`GPULedger`), its store, the writer that
follows the allocator, GPU-hour budgets at launch and during a session, Prometheus counters.

`gpulab.hub.config.GPULabHubHooks` calls `GPULedger.instance(...).attach_to_hub(app)` while the
hub initialises, before any spawn: the allocator's listener is registered at once (so no grant
is missed), the store opens, and a writer task writes the queued snapshots from a worker thread
(a database round trip never blocks the event loop). Every `reconcile_interval_seconds` the
writer asks the allocator for a fresh snapshot (`notify_listeners`): a change it missed (a
crash, pods lost while the hub was down, a node lost) is repaired there.

Nothing of the ledger crosses into a user's process: the database URL is in the hub's and the
gpulab-metrics service's environment only, and users read their own figures through the hub's
API, under `custom:gpulab:usage!user`, which names the owner: no tenant reads another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any

from traitlets import Bool, Dict, Float, Unicode, validate
from traitlets.config import SingletonConfigurable

from gpulab.hub.allocator import Request
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.capacity_catalog import HOUR_BUDGET_REFUSAL, HourBudgetStanding
from gpulab.hub.hub_service import cancel_and_wait, hub_started, stop_server
from gpulab.hub.ledger import BUDGET, Budget, HourQuota, HourQuotaError, budgets, tightest
from gpulab.hub.ledger.feed import LedgerFeed
from gpulab.hub.ledger.quota import EXHAUSTED, WARN, allocated_milli_seconds
from gpulab.hub.ledger.store import LedgerStore
from gpulab.hub.prometheus import register_collector

from .metrics import LedgerCollector

log = logging.getLogger("gpulab.ledger")


class GPULedger(SingletonConfigurable):
    """GPU-hours: what the allocator handed out, to whom and for how long (see
    gpulab.hub.ledger); budgets of GPU-hours per user and group."""

    enabled = Bool(
        True,
        config=True,
        help="""Keep the GPU-hour ledger (intervals of every GPU share, /hub/api/gpulab/usage,
        gpulab_gpu_hours_* on /hub/metrics, GPU-hour budgets).""",
    )
    db_url = Unicode(
        "sqlite:///gpulab-ledger.sqlite",
        config=True,
        help="""Where the ledger is kept, in SQLAlchemy's URL style: 'sqlite:///path' (relative
        to the hub's working directory; the embedded default) or 'postgresql://user@host/db'
        for cluster installs (needs gpulab[postgres]). It outlives hub restarts.""",
    )
    reconcile_interval_seconds = Float(
        30.0,
        config=True,
        help="""How often the ledger is compared with the allocator's whole state (changes are
        written as they happen; this repairs what a crash or a lost node left behind).""",
    )
    hour_quota_users = Dict(
        config=True,
        help="""GPU-hour budgets per user over `hour_quota_window_days`, in GPU-hours of
        allocated GPU (a quarter GPU for an hour is 0.25), e.g. {"alice": 100}.""",
    )
    hour_quota_groups = Dict(
        config=True,
        help="""GPU-hour budgets per JupyterHub group over `hour_quota_window_days` (every
        member's GPU-hours count towards her groups' budgets), e.g. {"students": 500}.""",
    )
    hour_quota_window_days = Float(
        30.0,
        config=True,
        help="""The rolling window GPU-hour budgets count over, in days.""",
    )
    hour_quota_warn_percent = Float(
        80.0,
        config=True,
        help="""A user is warned (picker, JupyterLab, log) once this share of a budget is used.""",
    )
    stop_when_exhausted = Bool(
        False,
        config=True,
        help="""Stop a user's GPU servers, jobs and Dask workers once a budget that binds her is
        used up (servers are stopped the way JupyterHub stops them, so their workspaces are
        checkpointed as at any stop). False: new GPU work is refused, running work goes on.""",
    )
    budget_check_interval_seconds = Float(
        60.0,
        config=True,
        help="""How often budgets are recomputed from the ledger and running work is checked
        against them. A launch is checked against the latest figures, so it may pass by up
        to this long's worth of the user's current holding.""",
    )

    @validate("reconcile_interval_seconds", "budget_check_interval_seconds")
    def _positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise HourQuotaError(f"GPULedger.{proposal['trait'].name}: must be > 0, got {value}")
        return value

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store: LedgerStore | None = None
        self.feed: LedgerFeed | None = None
        self.unavailable: str | None = None
        self.quota = self._quota()
        #: users' and groups' milli-GPU-seconds in the budget window (budget_check's figures)
        self.window_users: dict[str, int] = {}
        self.window_groups: dict[str, int] = {}
        self._warned: dict[tuple[str, str], str] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Future[None] | None = None
        self._stopping: set[asyncio.Future[Any]] = set()
        self.collector = LedgerCollector(self)

    def _quota(self) -> HourQuota:
        try:
            return HourQuota.parse(
                self.hour_quota_users,
                self.hour_quota_groups,
                self.hour_quota_window_days,
                self.hour_quota_warn_percent,
            )
        except HourQuotaError as e:
            raise HourQuotaError(f"GPULedger.hour_quota_{e}") from None

    @property
    def absolute_db_url(self) -> str:
        """The URL with a SQLite path made absolute (what another process is told)."""
        prefix = "sqlite:///"
        if self.db_url.startswith(prefix) and not self.db_url.startswith(prefix + "/"):
            path = self.db_url[len(prefix) :]
            if path and path != ":memory:":
                return prefix + str(Path(path).resolve())
        return self.db_url

    # -- wiring --------------------------------------------------------------------------------

    def attach_to_hub(self, app: Any) -> None:
        """Open the store and follow the allocator (see the module docstring). Called while
        the hub initialises, in its event loop."""
        if not self.enabled:
            self.unavailable = "the GPU-hour ledger is switched off on this hub (GPULedger.enabled)"
            return
        capacity = GPUCapacity.instance(config=self.config, log=self.log)
        self.start(capacity, started=lambda: hub_started(app), app=app)

    def start(self, capacity: GPUCapacity, *, started: Any = None, app: Any = None) -> None:
        """Follow `capacity`'s allocator (also for tests without a hub)."""
        self.store = LedgerStore(self.db_url)
        loop = asyncio.get_running_loop()

        def wake() -> None:  # from the allocator's thread
            loop.call_soon_threadsafe(self._wake.set)

        self.feed = LedgerFeed(self.store, lambda: capacity.inventory, on_queued=wake)
        capacity.add_allocator_listener(self.feed.listener)
        capacity.hour_budget_check = self.launch_refusal
        capacity.hour_budget_standing = self.standing
        register_collector("ledger", self.collector)
        self._task = asyncio.ensure_future(self._run(capacity, started, app))

    async def close(self) -> None:
        """Write what is queued and stop (a hub's clean shutdown, tests)."""
        await cancel_and_wait(self._task)
        self._task = None
        if self.feed is not None:
            await asyncio.to_thread(self.feed.flush)
        if self.store is not None:
            self.store.close()

    async def flush(self) -> None:
        """Write every queued change now (the API answers with what happened up to its call)."""
        if self.feed is not None and self.feed.pending:
            await asyncio.to_thread(self.feed.flush)

    async def _run(self, capacity: GPUCapacity, started: Any, app: Any) -> None:
        if started is not None:
            await started()
        # Never reconcile against an allocator that does not hold the real allocations yet (on
        # Kubernetes, the empty one before the cluster's watches synced): every open interval
        # would end as "released" and start again a moment later.
        while not capacity.synced:
            try:
                await capacity.ready()
            except Exception as e:
                log.warning("gpulab: GPU-hour ledger waits for the GPU inventory: %s", e)
                await asyncio.sleep(5)
        next_reconcile = next_budget = 0.0
        while True:
            now = time.monotonic()
            try:
                if now >= next_reconcile:
                    # the allocator's lock, briefly: in a thread, never on the event loop
                    await asyncio.to_thread(capacity.allocator.notify_listeners)
                    next_reconcile = now + self.reconcile_interval_seconds
                await self.flush()
                if now >= next_budget:
                    await asyncio.to_thread(self.refresh)
                    await self.enforce(capacity, app)
                    next_budget = now + self.budget_check_interval_seconds
            except Exception:  # a database outage must not end the ledger for good
                log.exception("gpulab: GPU-hour ledger write failed; trying again")
            self._wake.clear()
            timeout = max(0.05, min(next_reconcile, next_budget) - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    # -- budgets -------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Recompute the window's figures and the counters (a worker thread)."""
        assert self.store is not None
        now = int(time.time())
        if self.quota:
            since = now - self.quota.window_seconds
            users, groups = allocated_milli_seconds(self.store.intervals(since, now), since, now)
            self.window_users, self.window_groups = users, groups
        self.collector.refresh(self.store, now)

    def budgets_of(self, user: str, groups: frozenset[str] | tuple[str, ...]) -> list[Budget]:
        return budgets(self.quota, user, groups, self.window_users, self.window_groups)

    def launch_refusal(self, request: Request) -> str | None:
        """Why `request` may not start for lack of GPU-hours (None: it may)."""
        if not self.quota or request.total_gpu_milli == 0:
            return None
        found = tightest(self.budgets_of(request.owner, tuple(request.groups)))
        if found is None or found.state != EXHAUSTED:
            return None
        return self._refusal(found)

    def _refusal(self, budget: Budget) -> str:
        window = f"{self.hour_quota_window_days:g} days"
        return f"{HOUR_BUDGET_REFUSAL} ({budget.describe()} in the last {window})."

    def standing(self, user: str, groups: frozenset[str]) -> HourBudgetStanding | None:
        """The tightest budget binding `user` as the picker shows it: 'GPU-hours: 12.5 of 100
        left (30 days)', with the launch check's own refusal once it is used up."""
        found = tightest(self.budgets_of(user, tuple(groups)))
        if found is None:
            return None
        window = f"{self.hour_quota_window_days:g} days"
        if found.scope == "group":
            window += f", group {found.name}"
        text = (
            f"GPU-hours: {found.remaining_gpu_hours:.1f} of {found.limit_gpu_hours:g} left "
            f"({window})"
        )
        return HourBudgetStanding(text, self._refusal(found) if found.state == EXHAUSTED else "")

    async def enforce(self, capacity: GPUCapacity, app: Any) -> None:
        """Warn holders past the warning share of a budget (once per budget and state), and
        stop their GPU work when one is used up and `stop_when_exhausted` says so: at every
        check while it stays used up, since a server that was still starting at the first one
        is left to the next (`stop_server`)."""
        if not self.quota:
            return
        holders: dict[str, frozenset[str]] = {}
        for p in capacity.allocator.allocations():
            if p.gpu_milli:
                holders[p.request.owner] = p.request.groups
        for user, groups in holders.items():
            for budget in self.budgets_of(user, groups):
                key = (user, f"{budget.scope}:{budget.name}")
                if budget.state not in (WARN, EXHAUSTED):
                    continue
                if self._warned.get(key) != budget.state:
                    self._warned[key] = budget.state
                    if budget.state == WARN:
                        message = f"GPU-hour budget at {self.hour_quota_warn_percent:g} %: {budget.describe()}."
                    else:
                        message = f"GPU-hour budget used up: {budget.describe()}."
                        if self.stop_when_exhausted:
                            message += " Your GPU servers, jobs and Dask workers are being stopped."
                    log.warning("gpulab: %s (%s)", message, user)
                    capacity.record_notice(user, message)
                if budget.state == EXHAUSTED and self.stop_when_exhausted:
                    await self._stop_gpu_work(capacity, app, user, budget)

    async def _stop_gpu_work(
        self, capacity: GPUCapacity, app: Any, user: str, budget: Budget
    ) -> None:
        reason = f"GPU-hour budget used up ({budget.describe()})"
        for placement in capacity.allocator.allocations():
            if placement.request.owner != user or not placement.gpu_milli:
                continue
            if capacity.has_evictor(placement):  # a job run or a Dask worker
                # as for a preemption: the share is given back first, then its owner stops it
                # (a job run is queued again and waits for budget like any new run)
                await capacity.release(placement.request.id, reason=BUDGET)
                await capacity.evict(placement, reason)
                continue
            hub_user = app.users.get(user) if app is not None else None
            if hub_user is None:
                continue
            for name, spawner in list(hub_user.spawners.items()):
                if (
                    getattr(spawner, "allocation_id", None) == placement.request.id
                    and spawner.ready  # a pending start is stopped on the next check
                ):
                    log.warning("gpulab: stopping %s/%s: %s", user, name, reason)
                    # the ledger records the share as ended by the budget, once the stop is
                    # certain (a server that began stopping meanwhile is left to the next check)
                    noted = functools.partial(
                        capacity.note_end_reason, placement.request.id, BUDGET
                    )
                    # in the background: a stop takes seconds, and the ledger's writes go on
                    stop = asyncio.ensure_future(
                        stop_server(app, hub_user, name, before_stop=noted)
                    )
                    self._stopping.add(stop)
                    stop.add_done_callback(self._stopping.discard)
