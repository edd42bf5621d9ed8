"""Builders for gpulab.hub.culling tests: GPU sample series, observations, and a simulated clock
that runs decide() every check interval the way the hub-side service will."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpulab.hub.culling import (
    CullPolicy,
    CullRule,
    CullState,
    Decision,
    ServerObservation,
    SliceSample,
    decide,
)
from gpulab.hub.culling.model import UtilizationScope

NOW = 1_000_000.0
PUSH_SECONDS = 15.0  # the GPU monitor's default push interval
RULE = CullRule()  # T 1 h, U 5 %, T_gpu 30 min, W 15 min, checkpoint-stop
LIVE = CullPolicy(dry_run=False)
DRY_RUN = CullPolicy(dry_run=True)


def series(
    start: float,
    end: float,
    pct: float | None,
    scope: UtilizationScope = "device",
    every: float = PUSH_SECONDS,
) -> tuple[SliceSample, ...]:
    """Samples at ``pct`` every ``every`` seconds from ``start`` up to and including ``end``."""
    out = []
    t = start
    while t <= end:
        out.append(SliceSample(t, pct, scope))
        t += every
    return tuple(out)


def idle_server(**changes: Any) -> ServerObservation:
    """alice's whole-GPU server: no input for 2 h, its GPU at 1 % for 2 h (idle by RULE)."""
    base = ServerObservation(
        user="alice",
        server="",
        profile="gpu-full",
        held_milli=1000,
        started_at=NOW - 3 * 3600,
        last_user_input_at=NOW - 2 * 3600,
        slices={"GPU 0": series(NOW - 2 * 3600, NOW, 1.0)},
    )
    return replace(base, **changes)


def idle_server_at(t: float, **changes: Any) -> ServerObservation:
    """idle_server() seen at a later time ``t``: its GPU has kept pushing 1 % until ``t``."""
    return idle_server(slices={"GPU 0": series(NOW - 2 * 3600, t, 1.0)}, **changes)


def warned(observation: ServerObservation, seconds_ago: float, shown: bool = True) -> CullState:
    """The state of a server warned ``seconds_ago`` (a live warning unless ``shown`` is False)."""
    return CullState(NOW - seconds_ago, shown, observation.started_at)


def run_checks(
    policy: CullPolicy,
    observe: Callable[[float], ServerObservation],
    start: float,
    end: float,
    interval: float,
) -> list[Decision]:
    """decide() at start, start + interval, ... up to end, carrying the state between checks;
    stops after the first cull (the server is gone then)."""
    decisions: list[Decision] = []
    state = CullState()
    t = start
    while t <= end:
        decision = decide(policy, observe(t), state, t)
        decisions.append(decision)
        state = decision.state
        if decision.effect in ("stop", "checkpoint-stop", "downsize"):
            break
        t += interval
    return decisions
