"""GPU-aware culling inside a running hub (`GPUCuller`): the policy of gpulab.hub.culling, run.

`gpulab.hub.config.GPULabHubHooks` checks the policy at hub start (a bad value stops the hub with
the option's name) and calls `GPUCuller.instance(...).attach_to_hub(app)`. Once the hub has
started, every `check_interval_seconds` (on a fixed grid, so a cull lands at most one interval
after its warning ran out) the culler observes every running server that holds an allocation,
calls `decide()`, keeps the decision's state per server run, logs and counts it, and carries out
its effect. Where each fact comes from:

- GPU held, profile, devices: the server's placement in the allocator (`spawner.allocation_id`);
- GPU idleness: the ledger's live table, which gpulab-metrics fills from the servers' own pushes
  (each slice's latest figure and since when it stayed below the idle threshold); a slice with
  no current figure is unknown, never idle;
- real user input and busy kernels: the server's own report (`reports.py`, pushed by the lab
  extension to POST /hub/api/gpulab/users/{user}/servers/{server}/activity). Not JupyterHub's
  `last_activity`, which counts every request (an open GPU panel would keep a server forever);
- running jobs: the owner's job runs holding a share in the allocator;
- Dask work: tasks in the clusters made from this server (the Dask service's scheduler views);
- keep alive: the user's click, sent by the extension with the same report.

A warning reaches JupyterLab in the answer to the server's next report (`answer_for`); a stop is
JupyterHub's own (off the proxy, then `user.stop`), and gpulab's kernel extension checkpoints
every kernel's variables as the server shuts its kernels down, so a checkpoint-stop is that same
stop (`%gpulab_restore` brings the variables back). A downsize stops the server and starts it
again on the catalog's CPU-only profile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from traitlets import Bool, Dict, Float, Integer, validate
from traitlets.config import SingletonConfigurable

from gpulab.hub.allocator import Placement
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.culling import (
    CullConfigError,
    CullPolicy,
    CullState,
    Decision,
    RoundSummary,
    ServerObservation,
    SliceSample,
    SliceSummary,
    advance,
    decide,
    summarize_round,
)
from gpulab.hub.culling.model import MIN_IDLE_SECONDS
from gpulab.hub.hub_service import hub_started, stop_server
from gpulab.hub.jobservice.service import run_id_of
from gpulab.hub.ledger import CULLED, tightest
from gpulab.hub.ledger.store import LiveFigure, figures_of_shares
from gpulab.hub.ledgerservice import GPULedger
from gpulab.hub.profiles import Profile
from gpulab.hub.prometheus import register_collector

from .metrics import CullDecisionsCollector
from .reports import ServerReport

ServerKey = tuple[str, str]  # (user, server name)
STOPPING_EFFECTS = ("stop", "checkpoint-stop", "downsize")
#: how many decisions that acted the admin's view keeps (what was culled lately, and why)
RECENT_ACTIONS = 100


@dataclass(frozen=True)
class RunningServer:
    """A server the culler looks at in one round."""

    user: Any  # JupyterHub's User
    spawner: Any
    placement: Placement
    started_at: float

    @property
    def key(self) -> ServerKey:
        return (self.user.name, self.spawner.name)


class GPUCuller(SingletonConfigurable):
    """GPU-aware culling (issue 18): warns, then stops, checkpoints or moves to CPU the servers
    whose GPU stayed idle and whose users stayed away (gpulab.hub.culling's policy)."""

    enabled = Bool(
        True,
        config=True,
        help="""Run GPU-aware culling: check every running server each check_interval_seconds
        and act as `policy` says (in a dry run, only report what it would do: the policy's
        `dry_run`, true unless set).""",
    )
    policy = Dict(
        config=True,
        help="""The culling policy (gpulab.hub.culling.CullPolicy.from_config):
        {"dry_run": true, "stale_sample_seconds": 120, "default": {"ui_idle_seconds": 3600,
        "gpu_utilization_pct": 5, "gpu_idle_seconds": 1800, "warn_seconds": 900,
        "keep_alive_seconds": 14400, "action": "checkpoint-stop" | "stop" | "downsize",
        "enabled": true}, "profiles": {"<slug>": {...overrides...}}}. Every key is optional;
        profile slugs must be in the catalog. A mistake stops the hub at start, naming the key.
        dry_run defaults to true: set it to false once the dry run's "would cull" looks right.""",
    )
    check_interval_seconds = Float(
        60.0,
        config=True,
        help="""How often every running server is checked, in seconds: a server is culled at
        most this long after its warning ran out.""",
    )
    report_interval_seconds = Float(
        15.0,
        config=True,
        help="""How often each server reports its users' input and its busy kernels (told to
        the server in every answer), in seconds. A warning reaches JupyterLab at most this long
        after the check that made it; a kernel that went busy counts from its next report.""",
    )
    min_idle_seconds = Integer(
        MIN_IDLE_SECONDS,
        config=True,
        help="""The shortest ui_idle_seconds, gpu_idle_seconds and keep_alive_seconds the policy
        accepts. Lower it only for demonstrations and tests: below a minute a server is judged on
        one or two of its GPU monitor's pushes.""",
    )

    @validate("check_interval_seconds", "report_interval_seconds")
    def _positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 < value <= 3600:
            name = proposal["trait"].name
            raise CullConfigError(f"GPUCuller.{name}", f"{value:g} s is outside (0, 3600] s")
        return value

    @validate("min_idle_seconds")
    def _min_idle(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if not 1 <= value <= MIN_IDLE_SECONDS:
            raise CullConfigError(
                "GPUCuller.min_idle_seconds", f"{value} s is outside 1..{MIN_IDLE_SECONDS} s"
            )
        return value

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parsed: CullPolicy | None = None
        self.unavailable: str | None = None
        #: per server: the latest report, the keep-alive click's end, the policy's state, the
        #: latest decision; per slice: our own fold of its figures (see `slice_figures`)
        self.reports: dict[ServerKey, ServerReport] = {}
        self.keep_alive_until: dict[ServerKey, float] = {}
        self.states: dict[ServerKey, CullState] = {}
        self.decisions: dict[ServerKey, Decision] = {}
        self.folds: dict[tuple[str, str, str], SliceSummary] = {}
        #: the latest decisions that did something (warned, withdrew, culled), newest last
        self.recent_actions: deque[Decision] = deque(maxlen=RECENT_ACTIONS)
        self.summary: RoundSummary | None = None
        self.checked_at: float | None = None
        #: servers being stopped or moved to CPU now (not judged again meanwhile)
        self.acting: set[ServerKey] = set()
        self.collector = CullDecisionsCollector()
        self._app: Any = None
        self._capacity: GPUCapacity | None = None
        self._task: asyncio.Future[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()

    # -- config --------------------------------------------------------------------------------

    def load_policy(self, known_profiles: list[str]) -> CullPolicy:
        """Parse `policy` against the catalog's slugs; CullConfigError naming
        `GPUCuller.policy.<key>` (the hub refuses to start on it)."""
        try:
            self.parsed = CullPolicy.from_config(
                self.policy, known_profiles=known_profiles, min_idle_seconds=self.min_idle_seconds
            )
        except CullConfigError as e:
            raise CullConfigError(f"GPUCuller.policy.{e.field}", e.message) from None
        return self.parsed

    # -- wiring --------------------------------------------------------------------------------

    def attach_to_hub(self, app: Any) -> None:
        """Check the policy and start checking once the hub has started. Called while the hub
        initialises, in its event loop."""
        if not self.enabled:
            self.unavailable = "GPU-aware culling is switched off on this hub (GPUCuller.enabled)"
            return
        capacity = GPUCapacity.instance(config=self.config, log=self.log)
        if self.parsed is None:
            self.load_policy([p.slug for p in capacity.catalog])
        self._app, self._capacity = app, capacity
        register_collector("culling", self.collector)
        self._task = asyncio.ensure_future(self._run(app, capacity))

    async def close(self) -> None:
        for task in [self._task, *self._background]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = None

    async def _run(self, app: Any, capacity: GPUCapacity) -> None:
        await hub_started(app)
        with contextlib.suppress(Exception):
            await capacity.ready()
        interval = self.check_interval_seconds
        next_check = time.time()
        while True:
            # rounds on a fixed grid: `now` of successive rounds differs by whole intervals, so
            # a cull is decided at most one interval after its warning ran out, however long a
            # round took
            try:
                await self.check(app, capacity, next_check)
            except Exception:  # one failed round (a database outage) must not end culling
                self.log.exception("gpulab culling: a check failed; trying again")
            now = time.time()
            next_check += interval * max(1, int((now - next_check) // interval) + 1)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_check - now))
            if self._wake.is_set():  # a click: judge now, then back on the grid
                await self.check(app, capacity, time.time())
                next_check = max(next_check, time.time())

    # -- one round -----------------------------------------------------------------------------

    def running_servers(self, app: Any, capacity: GPUCapacity) -> list[RunningServer]:
        """Every server that is up (not starting or stopping) and holds an allocation."""
        out = []
        for user in list(app.users.values()):
            for name in list(user.orm_spawners):
                spawner = user.spawners[name]
                if not spawner.ready or (user.name, name) in self.acting:
                    continue
                allocation = getattr(spawner, "allocation_id", None)
                placement = capacity.allocator.get(str(allocation)) if allocation else None
                if placement is None:
                    continue
                started = spawner.orm_spawner.started
                started_at = (
                    started.replace(tzinfo=timezone.utc).timestamp()
                    if started is not None
                    else placement.created_at
                )
                out.append(RunningServer(user, spawner, placement, started_at))
        return out

    async def check(self, app: Any, capacity: GPUCapacity, now: float) -> list[Decision]:
        """One round: decide for every running server, act, log the round's summary."""
        policy = self.parsed
        assert policy is not None
        servers = self.running_servers(app, capacity)
        figures = await self.live_figures(policy, now)
        jobs = self.running_jobs(capacity, {s.placement.request.id for s in servers})
        decisions = []
        for server in servers:
            observation = self.observation_of(
                policy, server, figures.get(server.key, {}), jobs, now
            )
            previous = self.decisions.get(server.key)
            decision = decide(policy, observation, self.states.get(server.key, CullState()), now)
            self.states[server.key] = decision.state
            self.decisions[server.key] = decision
            decisions.append(decision)
            self.collector.count(decision.metric_labels())
            if decision.effect != "none":
                self.recent_actions.append(decision)
            # a line per change (and every warning and cull), not every server every round
            changed = previous is None or (previous.verdict, previous.causes) != (
                decision.verdict,
                decision.causes,
            )
            level = logging.INFO if changed or decision.effect != "none" else logging.DEBUG
            self.log.log(level, "gpulab culling: %s", decision.log_message())
            await self.carry_out(app, capacity, server, decision)
        self.forget_gone({s.key for s in servers} | self.acting)
        self.summary = summarize_round(decisions, dry_run=policy.dry_run)
        self.checked_at = now
        if decisions:
            self.log.info("gpulab culling: %s", self.summary.text())
        return decisions

    def forget_gone(self, running: set[ServerKey]) -> None:
        """Drop what is kept of servers that no longer run (a state belongs to one run)."""
        for table in (self.states, self.decisions, self.reports, self.keep_alive_until):
            for key in [k for k in table if k not in running]:
                del table[key]
        for fold in [k for k in self.folds if (k[0], k[1]) not in running]:
            del self.folds[fold]

    async def live_figures(
        self, policy: CullPolicy, now: float
    ) -> dict[ServerKey, dict[str, LiveFigure]]:
        """(user, server) -> device uuid -> its latest figure, none older than the policy's
        `stale_sample_seconds` (a read in a worker thread: never on the event loop)."""
        from gpulab.hub.ledgerservice import GPULedger

        ledger = GPULedger.instance(config=self.config, log=self.log)
        if ledger.store is None:
            return {}
        rows = await asyncio.to_thread(ledger.store.live_figures, now - policy.stale_sample_seconds)
        out: dict[ServerKey, dict[str, LiveFigure]] = {}
        for f in rows:
            out.setdefault((f.user, f.server), {})[f.device] = f
        return out

    @staticmethod
    def running_jobs(capacity: GPUCapacity, server_allocations: set[str]) -> Counter[str]:
        """Job runs holding a share now, per owner (a server named like a run is still a server)."""
        counts: Counter[str] = Counter()
        for p in capacity.allocator.allocations():
            if p.request.id not in server_allocations and run_id_of(p.request.id) is not None:
                counts[p.request.owner] += 1
        return counts

    def observation_of(
        self,
        policy: CullPolicy,
        server: RunningServer,
        figures: Mapping[str, LiveFigure],
        jobs: Counter[str],
        now: float,
    ) -> ServerObservation:
        user, name = server.key
        request = server.placement.request
        profile = request.profile or _profile_of(server.spawner.user_options) or ""
        rule = policy.rule_for(profile)
        report = self.reports.get(server.key)
        if report is not None and report.received_at < server.started_at:
            report = None  # from an earlier run of the server
        return ServerObservation(
            user=user,
            server=name,
            profile=profile,
            held_milli=server.placement.gpu_milli,
            started_at=server.started_at,
            last_user_input_at=report.last_user_input_at if report else None,
            slices=self.slice_figures(server, figures, rule.gpu_utilization_pct, policy),
            busy_kernels=report.busy_kernels if report else 0,
            running_jobs=jobs.get(user, 0),
            dask_tasks=self.dask_tasks(user, name),
            keep_alive_until=self.keep_alive_until.get(server.key),
        )

    def slice_figures(
        self,
        server: RunningServer,
        figures: Mapping[str, LiveFigure],
        threshold_pct: float,
        policy: CullPolicy,
    ) -> dict[str, SliceSummary]:
        """One SliceSummary per GPU share of the server's placement.

        Where gpulab-metrics judged the figures against the rule's own threshold, its
        `below_since` is used as it is (push by push, and it survives a hub restart). Under
        another threshold (a profile with its own U) the culler folds each figure it sees into
        a summary of its own, a check at a time. A share without a current figure is unknown."""
        user, name = server.key
        out: dict[str, SliceSummary] = {}
        # on Kubernetes the pod's monitor names the physical devices behind the allocator's slots
        matched = figures_of_shares([share.uuid for share in server.placement.gpus], figures)
        for share, figure in zip(server.placement.gpus, matched, strict=True):
            label = self.slice_name(share.uuid, out)
            fold_key = (user, name, share.uuid)
            if figure is None:
                out[label] = SliceSummary(threshold_pct)
                continue
            if figure.idle_threshold_pct == threshold_pct:
                out[label] = SliceSummary(
                    threshold_pct,
                    last_sample_at=figure.t,
                    below_since=figure.below_since,
                    latest_pct=figure.utilization_pct,
                )
                continue
            fold = self.folds.get(fold_key)
            if fold is None or fold.threshold_pct != threshold_pct:
                fold = SliceSummary(threshold_pct)
            sample = SliceSample(figure.t, figure.utilization_pct)
            fold = self.folds[fold_key] = advance(fold, sample, policy.stale_sample_seconds)
            out[label] = fold
        return out

    def slice_name(self, uuid: str, taken: Mapping[str, Any]) -> str:
        """'GPU 0' (the device's index on its node), or its uuid where that is ambiguous."""
        assert self._capacity is not None
        try:
            label = f"GPU {self._capacity.gpu_by_uuid(uuid).index}"
        except KeyError:
            return uuid
        return uuid if label in taken else label

    def dask_tasks(self, user: str, server: str) -> int:
        """Tasks processing, queued or waiting in the Dask clusters made from this server."""
        from gpulab.hub.daskservice.hub import GPUDask

        service = GPUDask.instance(config=self.config, log=self.log).service
        return service.tasks_of(user, server) if service is not None else 0

    # -- effects -------------------------------------------------------------------------------

    async def carry_out(
        self, app: Any, capacity: GPUCapacity, server: RunningServer, decision: Decision
    ) -> None:
        """Do what `decision.effect` says. A warning (and its withdrawal) is delivered in the
        answer to the server's next report; a stop or downsize runs in the background (a
        server's stop waits for its kernels to checkpoint), and one that fails is decided again
        at the next check (the state keeps the warning)."""
        effect = decision.effect
        if effect not in STOPPING_EFFECTS:
            return
        reason = f"culled: {decision.reason}"
        self.acting.add(server.key)
        task = asyncio.ensure_future(self._cull(app, capacity, server, effect, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cull(
        self, app: Any, capacity: GPUCapacity, server: RunningServer, effect: str, reason: str
    ) -> None:
        user, spawner = server.user, server.spawner
        label = f"{user.name}/{spawner.name}"
        try:
            cpu = self.cpu_profile(capacity) if effect == "downsize" else None
            if effect == "downsize" and cpu is None:
                self.log.warning(
                    "gpulab culling: %s: no CPU-only profile in the catalog to move it to;"
                    " stopping it instead",
                    label,
                )
            # the GPU-hour ledger records the share as culled, not as an ordinary release
            culled = functools.partial(
                capacity.note_end_reason, server.placement.request.id, CULLED
            )
            if not await stop_server(app, user, spawner.name, before_stop=culled):
                self.log.info("gpulab culling: %s is starting or stopping; not culled", label)
                return
            if cpu is not None:
                await start_server(app, user, spawner.name, cpu.slug)
                notice = f"Your idle GPU server was moved to {cpu.display_name} ({reason})."
            else:
                notice = f"Your idle GPU server was stopped; restore your variables with %gpulab_restore ({reason})."
            capacity.record_notice(user.name, notice)
            self.log.warning("gpulab culling: %s: %s done", label, "downsize" if cpu else "stop")
        except Exception:
            self.log.exception(
                "gpulab culling: %s of %s failed; the next check decides again", effect, label
            )
        finally:
            self.acting.discard(server.key)

    @staticmethod
    def cpu_profile(capacity: GPUCapacity) -> Profile | None:
        """The catalog's CPU-only profile a downsized server moves to (its default one first)."""
        cpu = [p for p in capacity.catalog if p.gpu == 0]
        return next((p for p in cpu if p.default), cpu[0] if cpu else None)

    # -- what servers and the panel ask ---------------------------------------------------------

    def receive_report(self, key: ServerKey, report: ServerReport, keep_alive: bool) -> None:
        """A server's report (gpulab.hub.apihandlers.culling); a keep-alive click exempts the
        server for the rule's keep_alive_seconds and has it judged again at once."""
        self.reports[key] = report
        if keep_alive and self.parsed is not None:
            profile = self.decisions[key].profile if key in self.decisions else ""
            until = report.received_at + self.parsed.rule_for(profile).keep_alive_seconds
            self.keep_alive_until[key] = until
            self.log.info("gpulab culling: %s/%s kept alive by its user until %.0f", *key, until)
            self._wake.set()

    def answer_for(self, key: ServerKey, now: float) -> dict[str, Any]:
        """What a server's report is answered with: the warning JupyterLab shows (null when
        none, or withdrawn) and when to report next."""
        decision = self.decisions.get(key)
        warning = None
        kept = self.keep_alive_until.get(key, 0.0) > now
        if (
            decision is not None
            and not kept
            and decision.verdict in ("warn", "wait")
            and decision.state.warning_shown
            and decision.deadline is not None
        ):
            assert self.parsed is not None and self._capacity is not None
            rule = self.parsed.rule_for(decision.profile)
            cpu = self.cpu_profile(self._capacity)
            warning = {
                "deadline": decision.deadline,
                "seconds_left": max(0.0, decision.deadline - now),
                "action": decision.cull_action,
                "reason": decision.reason,
                "keep_alive_seconds": rule.keep_alive_seconds,
                "switch_to_cpu": cpu.display_name if cpu is not None else None,
            }
        return {
            "culling": self.enabled,
            "report_interval_seconds": self.report_interval_seconds,
            "warning": warning,
            "keep_alive_until": self.keep_alive_until.get(key) if kept else None,
            "budget_notice": self.budget_notice(key[0]),
        }

    def budget_notice(self, user_name: str) -> dict[str, str] | None:
        """The user's tightest GPU-hour budget once it reaches its warning share (80 %) or runs
        out, for JupyterLab to show (the same report's answer: her own budget only)."""
        ledger = GPULedger.instance(config=self.config, log=self.log)
        user = self._app.users.get(user_name) if self._app is not None else None
        if ledger.store is None or user is None:
            return None
        groups = tuple(g.name for g in user.groups)
        found = tightest(ledger.budgets_of(user_name, groups))
        if found is None or found.state == "ok":
            return None
        if found.state == "exhausted":
            message = f"GPU-hour budget used up: {found.describe()}. New GPU work is refused."
        else:
            share = f"{ledger.hour_quota_warn_percent:g} %"
            message = f"GPU-hour budget past {share}: {found.describe()}."
        return {"state": found.state, "message": message}

    async def switch_to_cpu(self, key: ServerKey) -> str:
        """The user's "Switch to CPU" (JupyterLab's warning): restart on the CPU-only profile
        now. ValueError with a sentence when it cannot."""
        app, capacity = self._app, self._capacity
        if app is None or capacity is None:
            raise ValueError("GPU-aware culling is not running on this hub")
        cpu = self.cpu_profile(capacity)
        if cpu is None:
            raise ValueError("The catalog has no CPU-only profile to switch to")
        server = next((s for s in self.running_servers(app, capacity) if s.key == key), None)
        if server is None:
            raise ValueError("The server is not running (or is starting, stopping or moving)")
        self.acting.add(key)
        reason = "switched to CPU by its user"
        task = asyncio.ensure_future(self._cull(app, capacity, server, "downsize", reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return f"Moving to {cpu.display_name}: the server restarts without its GPU"

    def decision_json(self, owner: str, server: str) -> dict[str, Any] | None:
        """The admin panel's "culling" column of one server (None: not judged yet)."""
        decision = self.decisions.get((owner, server))
        if decision is None:
            return None
        return {
            "verdict": decision.verdict,
            "reason": decision.reason,
            "deadline": decision.deadline,
            "dry_run": decision.dry_run,
        }


async def start_server(app: Any, user: Any, name: str, profile: str) -> None:
    """Start a server again with another profile, as JupyterHub's spawn does without a request
    (`user.spawn`, then its route on the proxy)."""
    spawner = user.spawners[name]
    options = dict(spawner.user_options or {})
    options["profile"] = profile
    spawner._spawn_pending = True
    try:
        await user.spawn(name, options=options)
        await app.proxy.add_user(user, name)
    finally:
        spawner._spawn_pending = False


def _profile_of(user_options: Any) -> str | None:
    profile = user_options.get("profile") if isinstance(user_options, dict) else None
    return profile if isinstance(profile, str) and profile else None
