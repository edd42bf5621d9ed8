"""decide(): one server, one check, one decision with its reason.

    exempt/keep --idle--> warn --idle for W--> wait ... --> cull (the rule's action)
         ^                  |                    |
         +-- activity or exemption: the warning is withdrawn, and the idle clock starts over

A server is idle when no user input reached it for T and every GPU slice it holds stayed below U
for T_gpu (``slices.judge_slice``). Exemptions (busy kernels, running jobs, Dask work, a "keep
alive" click, a disabled rule, no GPU held) win over idleness. A server is never culled without
a warning at least W earlier that stayed valid throughout; in a dry run the same decisions are
made and reported, but the caller is never told to warn or cull.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..profiles import format_gpu_amount
from .model import CullAction, CullPolicy, CullRule, CullState, ServerObservation
from .slices import SliceStatus, duration, judge_slice

Verdict = Literal["keep", "exempt", "warn", "wait", "cull"]
VERDICTS: tuple[Verdict, ...] = ("keep", "exempt", "warn", "wait", "cull")

#: Why: a bounded set, fit for a metric label and the dry run's counts.
Cause = Literal[
    "no-gpu",
    "disabled",
    "keep-alive",
    "busy-kernels",
    "running-jobs",
    "dask-work",
    "ui-input",
    "gpu-busy",
    "gpu-idle-briefly",
    "gpu-unknown",
    "idle",
]
EXEMPTIONS: tuple[Cause, ...] = (
    "no-gpu",
    "disabled",
    "keep-alive",
    "busy-kernels",
    "running-jobs",
    "dask-work",
)

#: What the caller carries out now. Never a warning or a cull in a dry run.
Effect = Literal["none", "warn", "withdraw-warning", "stop", "checkpoint-stop", "downsize"]

ACTION_PHRASES: dict[CullAction, str] = {
    "stop": "stop it",
    "checkpoint-stop": "checkpoint its kernels and stop it",
    "downsize": "restart it on CPU only",
}


@dataclass(frozen=True)
class Decision:
    """What decide() concluded for one server at ``at``.

    ``verdict`` and ``reason`` are the policy's conclusion, identical in a dry run (for the log,
    the panel and the metric); ``effect`` is what the caller must do now, always "none" in a dry
    run except withdrawing a warning shown before the dry run began. ``state`` is to be stored
    and handed to the next decide() for this server."""

    user: str
    server: str
    profile: str
    at: float
    verdict: Verdict
    causes: tuple[Cause, ...]
    reason: str
    effect: Effect
    cull_action: CullAction | None  # warn/wait/cull: what happens (or would) when it is due
    deadline: float | None  # warn/wait/cull: when the warning runs out
    warning_withdrawn: bool
    dry_run: bool
    held_milli: int
    state: CullState

    @property
    def would_cull(self) -> bool:
        """The policy culls this server now (carried out only when ``effect`` says so)."""
        return self.verdict == "cull"

    @property
    def key(self) -> str:
        return f"{self.user}/{self.server}"

    def log_message(self) -> str:
        mode = " (dry run)" if self.dry_run else ""
        action = f" ({self.cull_action})" if self.verdict == "cull" else ""
        return f"{self.key} [{self.profile or 'no profile'}]: {self.verdict}{action}{mode}: {self.reason}"

    def metric_labels(self) -> dict[str, str]:
        """Bounded labels for a decisions counter: no user or server names."""
        return {
            "verdict": self.verdict,
            "cause": self.causes[0],
            "profile": self.profile,
            "mode": "dry-run" if self.dry_run else "live",
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "server": self.server,
            "profile": self.profile,
            "at": self.at,
            "verdict": self.verdict,
            "causes": list(self.causes),
            "reason": self.reason,
            "effect": self.effect,
            "cull_action": self.cull_action,
            "deadline": self.deadline,
            "warning_withdrawn": self.warning_withdrawn,
            "dry_run": self.dry_run,
            "held_milli": self.held_milli,
        }


def decide(
    policy: CullPolicy, observation: ServerObservation, state: CullState, now: float
) -> Decision:
    """The decision for ``observation`` at ``now``, given the ``state`` of the previous check.

    Pure and deterministic: the same arguments give the same decision (slices are judged in the
    order of their names). ValueError when a slice's SliceSummary was folded against another
    threshold than the profile's rule (summarise again after the rule changed)."""
    obs = observation
    rule = policy.rule_for(obs.profile)
    dry_run = policy.dry_run
    if state.server_started_at is not None and state.server_started_at != obs.started_at:
        state = CullState()  # a new run of the server (restarted, downsized): nothing carries over
    warned_at = state.warned_at
    shown_before = warned_at is not None and state.warning_shown
    if not dry_run and not state.warning_shown:
        warned_at = None  # a dry run's simulated warning: nobody saw it, so it counts for nothing

    exempt = _exemptions(rule, obs, now)
    if exempt:
        verdict: Verdict = "exempt"
        causes, phrases = _unzip(exempt)
        reason = "; ".join(phrases)
    else:
        not_idle, idle_phrases = _idleness(policy, rule, obs, now)
        if not_idle:
            verdict = "keep"
            causes, phrases = _unzip(not_idle)
            reason = "; ".join(phrases)
        else:
            causes = ("idle",)
            idle = " and ".join(idle_phrases)
            doing = ACTION_PHRASES[rule.action]
            if warned_at is None:
                verdict, warned_at = "warn", now
                reason = f"{idle}: will {doing} in {duration(rule.warn_seconds)} unless used"
            elif now - warned_at >= rule.warn_seconds:
                verdict = "cull"
                reason = f"{idle}, warned {duration(now - warned_at)} ago: {doing}"
            else:
                verdict = "wait"
                left = warned_at + rule.warn_seconds - now
                reason = (
                    f"{idle}: warned {duration(now - warned_at)} ago, will {doing} in"
                    f" {duration(left)} unless used"
                )

    withdrawn = verdict in ("keep", "exempt") and warned_at is not None
    if withdrawn:
        reason = f"warning withdrawn: {reason}"
    pending = verdict in ("warn", "wait", "cull")
    effect: Effect = "none"
    if dry_run:
        if shown_before:
            effect = "withdraw-warning"  # shown while live; a dry run carries nothing out
            reason += " (dry run: the warning shown earlier is withdrawn)"
    elif verdict == "warn":
        effect = "warn"
    elif verdict == "cull":
        effect = rule.action
    elif withdrawn:
        effect = "withdraw-warning"

    new_state = CullState(
        warned_at=warned_at if pending else None,
        warning_shown=pending and not dry_run,
        server_started_at=obs.started_at,
    )
    return Decision(
        user=obs.user,
        server=obs.server,
        profile=obs.profile,
        at=now,
        verdict=verdict,
        causes=causes,
        reason=reason,
        effect=effect,
        cull_action=rule.action if pending else None,
        deadline=warned_at + rule.warn_seconds if pending and warned_at is not None else None,
        warning_withdrawn=withdrawn,
        dry_run=dry_run,
        held_milli=obs.held_milli,
        state=new_state,
    )


def _exemptions(rule: CullRule, obs: ServerObservation, now: float) -> list[tuple[Cause, str]]:
    if obs.held_milli <= 0:
        return [("no-gpu", "holds no GPU: GPU-aware culling does not apply")]
    if not rule.enabled:
        return [("disabled", f"culling is disabled for profile {obs.profile or '(none)'}")]
    out: list[tuple[Cause, str]] = []
    if obs.keep_alive_until is not None and obs.keep_alive_until > now:
        left = duration(obs.keep_alive_until - now)
        out.append(("keep-alive", f"kept alive by its user for {left} more"))
    if obs.busy_kernels > 0:
        out.append(("busy-kernels", _count(obs.busy_kernels, "kernel", "busy")))
    if obs.running_jobs > 0:
        out.append(("running-jobs", _count(obs.running_jobs, "job", "running")))
    if obs.dask_tasks > 0:
        out.append(("dask-work", _count(obs.dask_tasks, "Dask task", "in progress")))
    return out


def _idleness(
    policy: CullPolicy, rule: CullRule, obs: ServerObservation, now: float
) -> tuple[list[tuple[Cause, str]], list[str]]:
    """(what keeps the server, what shows it idle): the first is empty when it is idle."""
    not_idle: list[tuple[Cause, str]] = []
    idle: list[str] = []

    ui_since = obs.started_at
    if obs.last_user_input_at is not None:
        ui_since = max(ui_since, obs.last_user_input_at)
    ui_idle = now - ui_since
    if ui_idle < rule.ui_idle_seconds:
        needs = f"culling needs {duration(rule.ui_idle_seconds)} without"
        if obs.last_user_input_at is None:
            phrase = f"no UI input since it started {duration(ui_idle)} ago ({needs})"
        else:
            phrase = f"UI input {duration(ui_idle)} ago ({needs})"
        not_idle.append(("ui-input", phrase))

    if not obs.slices:
        held = format_gpu_amount(obs.held_milli)
        not_idle.append(("gpu-unknown", f"holds {held} but no GPU figures arrived (unknown)"))
    statuses: list[SliceStatus] = [
        judge_slice(
            name,
            obs.slices[name],
            threshold_pct=rule.gpu_utilization_pct,
            idle_seconds_needed=rule.gpu_idle_seconds,
            stale_seconds=policy.stale_sample_seconds,
            fractional=obs.is_fractional,
            now=now,
        )
        for name in sorted(obs.slices)
    ]
    for status in statuses:
        if status.idleness == "idle":
            idle.append(status.detail)
        elif status.idleness == "busy":
            not_idle.append(("gpu-busy", status.detail))
        elif status.idleness == "idle-briefly":
            not_idle.append(("gpu-idle-briefly", status.detail))
        else:
            not_idle.append(("gpu-unknown", f"{status.detail}, never counted as idle"))

    if ui_idle >= rule.ui_idle_seconds:
        idle.append(f"no UI input for {duration(ui_idle)}")
    return not_idle, idle


def _unzip(pairs: list[tuple[Cause, str]]) -> tuple[tuple[Cause, ...], list[str]]:
    causes: list[Cause] = []
    for cause, _ in pairs:
        if cause not in causes:
            causes.append(cause)
    return tuple(causes), [phrase for _, phrase in pairs]


def _count(n: int, noun: str, state: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'} {state}"
