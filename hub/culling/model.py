"""The culling policy's values: rules per profile parsed from config, what is observed of a
server, and the little state kept between two checks (frozen dataclasses, no I/O).

Config arrives as plain dicts (traitlets values, Helm values); every refusal is a
``CullConfigError`` whose ``field`` names the key to fix, e.g. ``profiles.gpu-full.warn_seconds``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

from ..profiles import MILLI_PER_GPU

CullAction = Literal["stop", "checkpoint-stop", "downsize"]
CULL_ACTIONS: tuple[CullAction, ...] = ("stop", "checkpoint-stop", "downsize")

UtilizationScope = Literal["device", "own_processes"]
UTILIZATION_SCOPES: tuple[UtilizationScope, ...] = ("device", "own_processes")

# Defaults (the README says where each comes from)
DEFAULT_UI_IDLE_SECONDS = 3600
DEFAULT_GPU_UTILIZATION_PCT = 5.0
DEFAULT_GPU_IDLE_SECONDS = 1800
DEFAULT_WARN_SECONDS = 900
DEFAULT_KEEP_ALIVE_SECONDS = 4 * 3600
DEFAULT_ACTION: CullAction = "checkpoint-stop"
DEFAULT_STALE_SAMPLE_SECONDS = 120
#: How often the hub-side service should call decide(); a server is culled at most this long
#: after its warning ran out.
DEFAULT_CHECK_INTERVAL_SECONDS = 60

# Durations below a minute would judge a server on one or two pushes of its GPU monitor (every
# 15 s); beyond a week a rule no longer culls anything anyone waits for.
MIN_IDLE_SECONDS = 60
MAX_SECONDS = 7 * 86400


class CullConfigError(ValueError):
    """A culling config value was refused; ``field`` names the key to fix, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class CullRule:
    """When a server of one profile is culled, and how.

    A server is idle when no user input reached it for ``ui_idle_seconds`` (T) AND every GPU
    slice it holds stayed below ``gpu_utilization_pct`` (U) for ``gpu_idle_seconds`` (T_gpu).
    An idle server is warned, and culled with ``action`` once it stayed idle ``warn_seconds``
    (W) after the warning. A click on "keep alive" exempts it for ``keep_alive_seconds``.
    """

    ui_idle_seconds: int = DEFAULT_UI_IDLE_SECONDS
    gpu_utilization_pct: float = DEFAULT_GPU_UTILIZATION_PCT
    gpu_idle_seconds: int = DEFAULT_GPU_IDLE_SECONDS
    warn_seconds: int = DEFAULT_WARN_SECONDS
    keep_alive_seconds: int = DEFAULT_KEEP_ALIVE_SECONDS
    action: CullAction = DEFAULT_ACTION
    enabled: bool = True

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        base: CullRule | None = None,
        where: str = "",
        min_idle_seconds: int = MIN_IDLE_SECONDS,
    ) -> CullRule:
        """A rule from a (partial) dict merged over ``base`` (the built-in defaults when None).

        ``where`` prefixes the field names in errors (e.g. ``profiles.gpu-full``);
        ``min_idle_seconds``: the shortest T, T_gpu and keep-alive accepted."""
        prefix = f"{where}." if where else ""
        if not isinstance(data, Mapping):
            raise CullConfigError(
                where or "rule", f"expected a mapping of rule fields, got {data!r}"
            )
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise CullConfigError(
                    f"{prefix}{key}", f"no such rule field; known: {', '.join(sorted(known))}"
                )
        rule = base if base is not None else cls()
        changes: dict[str, Any] = {}
        for key, value in data.items():
            name = f"{prefix}{key}"
            if key == "gpu_utilization_pct":
                changes[key] = _parse_percentage(name, value)
            elif key == "action":
                if value not in CULL_ACTIONS:
                    raise CullConfigError(
                        name, f"{value!r} is not an action; use one of {', '.join(CULL_ACTIONS)}"
                    )
                changes[key] = value
            elif key == "enabled":
                if not isinstance(value, bool):
                    raise CullConfigError(name, f"expected true or false, got {value!r}")
                changes[key] = value
            else:
                # a warning of 0 s is allowed: the server is still warned, and culled at the next check
                minimum = 0 if key == "warn_seconds" else min_idle_seconds
                changes[key] = _parse_seconds(name, value, minimum)
        return replace(rule, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CullPolicy:
    """The whole culling config: a default rule, per-profile rules, and global settings.

    ``dry_run``: decide and report, never act (no warning shown, nothing stopped).
    ``stale_sample_seconds``: a slice whose latest sample is older than this, or whose samples
    have a longer gap, is unknown (never idle) over that time.
    """

    default: CullRule = CullRule()
    profiles: Mapping[str, CullRule] = field(default_factory=lambda: MappingProxyType({}))
    dry_run: bool = True
    stale_sample_seconds: int = DEFAULT_STALE_SAMPLE_SECONDS

    def rule_for(self, profile: str) -> CullRule:
        """The profile's rule; the default for a profile without overrides (or unknown)."""
        return self.profiles.get(profile, self.default)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        known_profiles: Iterable[str] | None = None,
        min_idle_seconds: int = MIN_IDLE_SECONDS,
    ) -> CullPolicy:
        """Parse ``{"dry_run": ..., "stale_sample_seconds": ..., "default": {...},
        "profiles": {slug: {...partial rule...}}}``; every key is optional.

        Each profile's dict is merged over the (parsed) default rule. With ``known_profiles``,
        overrides for a slug the catalog does not have are refused (a typo would silently apply
        the default rule instead). ``min_idle_seconds`` lowers the floor of T and T_gpu (a
        demo's or a test's seconds-long rules); the default refuses anything under a minute."""
        if not isinstance(config, Mapping):
            raise CullConfigError("culling", f"expected a mapping, got {config!r}")
        allowed = ("default", "dry_run", "profiles", "stale_sample_seconds")
        for key in config:
            if key not in allowed:
                raise CullConfigError(str(key), f"no such setting; known: {', '.join(allowed)}")
        floor = min_idle_seconds
        default = CullRule.from_dict(
            config.get("default") or {}, where="default", min_idle_seconds=floor
        )
        raw_profiles = config.get("profiles") or {}
        if not isinstance(raw_profiles, Mapping):
            raise CullConfigError(
                "profiles", f"expected a mapping of profile slug to rule, got {raw_profiles!r}"
            )
        known = set(known_profiles) if known_profiles is not None else None
        profiles: dict[str, CullRule] = {}
        for slug, partial in raw_profiles.items():
            where = f"profiles.{slug}"
            if not isinstance(slug, str) or not slug:
                raise CullConfigError(where, "a profile slug must be a non-empty string")
            if known is not None and slug not in known:
                listed = ", ".join(sorted(known)) or "none"
                raise CullConfigError(where, f"no profile {slug!r} in the catalog; known: {listed}")
            profiles[slug] = CullRule.from_dict(
                partial, base=default, where=where, min_idle_seconds=floor
            )
        dry_run = config.get("dry_run", True)
        if not isinstance(dry_run, bool):
            raise CullConfigError("dry_run", f"expected true or false, got {dry_run!r}")
        stale = _parse_seconds(
            "stale_sample_seconds",
            config.get("stale_sample_seconds", DEFAULT_STALE_SAMPLE_SECONDS),
            minimum=1,
            maximum=3600,
        )
        return cls(default, MappingProxyType(profiles), dry_run, stale)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "stale_sample_seconds": self.stale_sample_seconds,
            "default": self.default.to_dict(),
            "profiles": {slug: rule.to_dict() for slug, rule in sorted(self.profiles.items())},
        }


def _parse_seconds(name: str, value: Any, minimum: int, maximum: int = MAX_SECONDS) -> int:
    # integral floats (3600.0 from YAML or arithmetic) are fine; 90.5 s is a typo, not a duration
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CullConfigError(name, f"expected a whole number of seconds, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise CullConfigError(name, f"expected a whole number of seconds, got {value!r}")
    seconds = int(value)
    if not minimum <= seconds <= maximum:
        raise CullConfigError(name, f"{seconds} s is outside {minimum}..{maximum} s")
    return seconds


def _parse_percentage(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CullConfigError(name, f"expected a percentage like 5, got {value!r}")
    if not 0 < value <= 100:
        # U = 0 would mean "never idle": say so rather than accept a rule that never culls
        raise CullConfigError(
            name, f"{value!r} is outside (0, 100]; to never cull, set enabled to false"
        )
    return float(value)


ActivityKind = Literal[
    "ui-input",
    "kernel-execute",
    "terminal-input",
    "api-request",
    "gpu-panel-poll",
    "metrics-push",
    "kernel-status",
]
#: What a person did. Everything else a server sees (API requests, the GPU panel's polling, its
#: metric pushes, kernel status messages, websocket pings) happens with nobody at the keyboard.
USER_INPUT_KINDS: frozenset[str] = frozenset({"ui-input", "kernel-execute", "terminal-input"})


@dataclass(frozen=True)
class Activity:
    """Something that happened on a server at ``at``; only USER_INPUT_KINDS are user input."""

    kind: ActivityKind
    at: float


def last_user_input(activities: Iterable[Activity]) -> float | None:
    """The latest user input among ``activities`` (None when there is none): what
    ``ServerObservation.last_user_input_at`` takes. A kind this module does not list as input
    never counts, so a new background poller cannot keep servers alive by accident."""
    times = [a.at for a in activities if a.kind in USER_INPUT_KINDS]
    return max(times) if times else None


@dataclass(frozen=True)
class SliceSample:
    """One reading of one GPU slice a server holds.

    ``scope`` says whose work the figure counts: ``own_processes`` is the server's own processes
    (what a fractional share should report); ``device`` is the whole device, which on a
    fractional share includes the neighbours' work. None: the monitor could not tell."""

    t: float
    utilization_pct: float | None
    scope: UtilizationScope = "device"


@dataclass(frozen=True)
class SliceSummary:
    """One slice's samples folded against one threshold (``slices.summarize``/``slices.advance``),
    for a service that keeps a summary per slice instead of a window of samples.

    ``below_since``: first sample of the current unbroken run below ``threshold_pct`` (None when
    the latest sample is not below, or unknown); ``last_sample_at``: the latest sample's time."""

    threshold_pct: float
    last_sample_at: float | None = None
    below_since: float | None = None
    latest_pct: float | None = None
    latest_scope: UtilizationScope = "device"


SliceFigures: TypeAlias = Sequence[SliceSample] | SliceSummary


@dataclass(frozen=True)
class ServerObservation:
    """What the hub-side service knows of one running server at one check.

    ``last_user_input_at`` is the latest REAL user input: keys and clicks in JupyterLab, a cell
    executed, terminal input. It must NOT be fed from JupyterHub's ``last_activity`` or the
    proxy's route activity, because those count every API request: the GPU panel's own polling
    (and any other widget's) would keep an abandoned server alive forever. None: no input since
    the server started (``started_at``).

    ``slices``: each GPU share the server holds (a whole GPU, a fraction of one, a MIG
    instance), keyed by a name used in reasons (e.g. "GPU 0" or the device uuid), with its
    recent samples or a summary. ``held_milli``: the GPU the server holds in milli-GPU (1000 = one
    GPU; 0 for a CPU-only server).

    Exemption facts: ``busy_kernels`` (kernels executing now), ``running_jobs`` (jobs running on
    behalf of this server), ``dask_tasks`` (tasks processing, queued or waiting in Dask clusters
    made from this server), ``keep_alive_until`` (the user clicked "keep alive")."""

    user: str
    server: str
    profile: str
    held_milli: int
    started_at: float
    last_user_input_at: float | None = None
    slices: Mapping[str, SliceFigures] = field(default_factory=lambda: MappingProxyType({}))
    busy_kernels: int = 0
    running_jobs: int = 0
    dask_tasks: int = 0
    keep_alive_until: float | None = None

    @property
    def key(self) -> str:
        return f"{self.user}/{self.server}"

    @property
    def is_fractional(self) -> bool:
        """A share of one GPU: its device figure includes the neighbours' work."""
        return 0 < self.held_milli < MILLI_PER_GPU


@dataclass(frozen=True)
class CullState:
    """What decide() remembers of one server between checks; the caller stores it and hands it
    back (a fresh ``CullState()`` for a server seen for the first time).

    ``warning_shown`` is False for a dry run's simulated warning: once the policy goes live, a
    warning nobody saw never counts towards a cull. ``server_started_at`` ties the state to one
    run of the server, so a restarted (or downsized) server starts afresh."""

    warned_at: float | None = None
    warning_shown: bool = False
    server_started_at: float | None = None
