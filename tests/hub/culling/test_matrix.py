"""The culling matrix: one server at the moment its warning ran out, each scenario with the exact
decision. Zero false culls: whatever is busy, or unknown, keeps it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gpulab.hub.culling import (
    Activity,
    CullPolicy,
    CullState,
    ServerObservation,
    SliceSample,
    decide,
    last_user_input,
)
from tests.harness.culling import LIVE, NOW, RULE, idle_server, series, warned


@dataclass(frozen=True)
class Case:
    changes: dict[str, Any]
    verdict: str
    causes: tuple[str, ...]
    effect: str
    reason: str
    warned: bool = True  # decided with a live warning given W ago (else a fresh state)
    extra: dict[str, Any] = field(default_factory=dict)


WARNED = "warning withdrawn: "
IDLE_2H = "GPU 0 below 5% for 2 h and no UI input for 2 h"
TWO_HOURS = series(NOW - 2 * 3600, NOW, 1.0)

# the GPU panel polls the server's API every few seconds while it is open; JupyterHub's
# last_activity would count each poll, the culling policy counts none
PANEL_ONLY = [Activity("ui-input", NOW - 2 * 3600)] + [
    Activity("gpu-panel-poll", t) for t in range(int(NOW - 2 * 3600), int(NOW) + 1, 5)
]

CASES = {
    "idle GPU and no UI input: culled": Case(
        {},
        "cull",
        ("idle",),
        "checkpoint-stop",
        f"{IDLE_2H}, warned 15 min ago: checkpoint its kernels and stop it",
    ),
    "busy kernel": Case(
        {"busy_kernels": 1},
        "exempt",
        ("busy-kernels",),
        "withdraw-warning",
        f"{WARNED}1 kernel busy",
    ),
    "running job": Case(
        {"running_jobs": 2},
        "exempt",
        ("running-jobs",),
        "withdraw-warning",
        f"{WARNED}2 jobs running",
    ),
    "active Dask cluster": Case(
        {"dask_tasks": 12},
        "exempt",
        ("dask-work",),
        "withdraw-warning",
        f"{WARNED}12 Dask tasks in progress",
    ),
    "keep alive clicked": Case(
        {"keep_alive_until": NOW + 3 * 3600},
        "exempt",
        ("keep-alive",),
        "withdraw-warning",
        f"{WARNED}kept alive by its user for 3 h more",
    ),
    "several exemptions at once": Case(
        {"busy_kernels": 3, "dask_tasks": 1},
        "exempt",
        ("busy-kernels", "dask-work"),
        "withdraw-warning",
        f"{WARNED}3 kernels busy; 1 Dask task in progress",
    ),
    "recent UI input": Case(
        {"last_user_input_at": NOW - 180},
        "keep",
        ("ui-input",),
        "withdraw-warning",
        f"{WARNED}UI input 3 min ago (culling needs 1 h without)",
    ),
    "one slice busy, one idle": Case(
        {
            "held_milli": 2000,
            "slices": {"GPU 0": TWO_HOURS, "GPU 1": series(NOW - 2 * 3600, NOW, 40.0)},
        },
        "keep",
        ("gpu-busy",),
        "withdraw-warning",
        f"{WARNED}GPU 1 at 40%",
    ),
    "slice idle for less than T_gpu": Case(
        {"slices": {"GPU 0": series(NOW - 3600, NOW - 1200, 60.0) + series(NOW - 1185, NOW, 1.0)}},
        "keep",
        ("gpu-idle-briefly",),
        "withdraw-warning",
        f"{WARNED}GPU 0 below 5% for 19 min, not yet 30 min",
    ),
    "stale samples: unknown is never idle": Case(
        {"slices": {"GPU 0": series(NOW - 2 * 3600, NOW - 600, 1.0)}},
        "keep",
        ("gpu-unknown",),
        "withdraw-warning",
        f"{WARNED}GPU 0: no GPU sample for 10 min (unknown), never counted as idle",
    ),
    "a gap in the samples restarts the idle run": Case(
        {
            "slices": {
                "GPU 0": series(NOW - 2 * 3600, NOW - 1500, 1.0) + series(NOW - 1200, NOW, 1.0)
            }
        },
        "keep",
        ("gpu-idle-briefly",),
        "withdraw-warning",
        f"{WARNED}GPU 0 below 5% for 20 min, not yet 30 min",
    ),
    "no GPU figures at all": Case(
        {"slices": {}},
        "keep",
        ("gpu-unknown",),
        "withdraw-warning",
        f"{WARNED}holds 1 GPU but no GPU figures arrived (unknown)",
    ),
    "utilisation not measurable (e.g. a MIG instance)": Case(
        {"slices": {"MIG 0": series(NOW - 2 * 3600, NOW, None)}},
        "keep",
        ("gpu-unknown",),
        "withdraw-warning",
        f"{WARNED}MIG 0: utilisation not measurable (unknown), never counted as idle",
    ),
    "fractional share, device busy with a neighbour, own processes idle: culled per slice": Case(
        {
            "profile": "gpu-quarter",
            "held_milli": 250,
            "slices": {"GPU 0": series(NOW - 2 * 3600, NOW, 0.5, scope="own_processes")},
        },
        "cull",
        ("idle",),
        "checkpoint-stop",
        f"{IDLE_2H}, warned 15 min ago: checkpoint its kernels and stop it",
    ),
    "fractional share with only the whole-device figure, busy: kept": Case(
        {
            "profile": "gpu-quarter",
            "held_milli": 250,
            "slices": {"GPU 0": series(NOW - 2 * 3600, NOW, 90.0, scope="device")},
        },
        "keep",
        ("gpu-busy",),
        "withdraw-warning",
        f"{WARNED}GPU 0 at 90% (whole-device figure, neighbours included:"
        " the share's own is not measured)",
    ),
    "open GPU panel only: its polling is no UI activity, culled": Case(
        {"last_user_input_at": last_user_input(PANEL_ONLY)},
        "cull",
        ("idle",),
        "checkpoint-stop",
        f"{IDLE_2H}, warned 15 min ago: checkpoint its kernels and stop it",
    ),
    "CPU-only server: never": Case(
        {"profile": "cpu", "held_milli": 0, "slices": {}},
        "exempt",
        ("no-gpu",),
        "none",
        "holds no GPU: GPU-aware culling does not apply",
        warned=False,
    ),
    "idle, not yet warned: warned": Case(
        {},
        "warn",
        ("idle",),
        "warn",
        f"{IDLE_2H}: will checkpoint its kernels and stop it in 15 min unless used",
        warned=False,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_culling_matrix(name: str) -> None:
    case = CASES[name]
    observation = idle_server(**case.changes)
    state = warned(observation, RULE.warn_seconds) if case.warned else CullState()
    decision = decide(LIVE, observation, state, NOW)
    assert (decision.verdict, decision.causes, decision.effect, decision.reason) == (
        case.verdict,
        case.causes,
        case.effect,
        case.reason,
    )


def test_panel_polling_leaves_the_last_user_input_where_it_was() -> None:
    assert last_user_input(PANEL_ONLY) == NOW - 2 * 3600


def test_only_person_made_activity_counts_as_user_input() -> None:
    activities = [
        Activity("kernel-execute", 10.0),
        Activity("terminal-input", 20.0),
        Activity("api-request", 30.0),
        Activity("metrics-push", 40.0),
        Activity("kernel-status", 50.0),
    ]
    assert last_user_input(activities) == 20.0
    assert last_user_input([Activity("gpu-panel-poll", 5.0)]) is None


def test_a_server_with_no_input_since_it_started_is_ui_idle_from_its_start() -> None:
    observation = idle_server(started_at=NOW - 600, last_user_input_at=None)
    decision = decide(LIVE, observation, CullState(), NOW)
    assert (decision.verdict, decision.reason) == (
        "keep",
        "no UI input since it started 10 min ago (culling needs 1 h without)",
    )


def test_every_cause_that_keeps_a_server_is_named_in_order() -> None:
    observation = idle_server(
        held_milli=2000,
        last_user_input_at=NOW - 60,
        slices={
            "GPU 1": series(NOW - 3600, NOW, 50.0),
            "GPU 0": (SliceSample(NOW - 900, 2.0),),
        },
    )
    decision = decide(LIVE, observation, CullState(), NOW)
    assert decision.causes == ("ui-input", "gpu-unknown", "gpu-busy")
    assert decision.reason == (
        "UI input 1 min ago (culling needs 1 h without); "
        "GPU 0: no GPU sample for 15 min (unknown), never counted as idle; GPU 1 at 50%"
    )


def test_a_profile_with_culling_disabled_is_exempt() -> None:
    policy = CullPolicy.from_config(
        {"dry_run": False, "profiles": {"gpu-full": {"enabled": False}}}
    )
    decision = decide(policy, idle_server(), CullState(), NOW)
    assert (decision.verdict, decision.causes, decision.reason) == (
        "exempt",
        ("disabled",),
        "culling is disabled for profile gpu-full",
    )


def test_a_profiles_own_action_is_what_it_culls_with() -> None:
    policy = CullPolicy.from_config(
        {"dry_run": False, "profiles": {"gpu-full": {"action": "downsize"}}}
    )
    observation = idle_server()
    decision = decide(policy, observation, warned(observation, 900), NOW)
    assert (decision.effect, decision.cull_action) == ("downsize", "downsize")
    assert decision.reason.endswith("warned 15 min ago: restart it on CPU only")


def test_the_decision_names_its_server_and_the_gpu_it_holds() -> None:
    observation: ServerObservation = idle_server(user="bob", server="train")
    decision = decide(LIVE, observation, CullState(), NOW)
    assert (decision.key, decision.held_milli, decision.at) == ("bob/train", 1000, NOW)
