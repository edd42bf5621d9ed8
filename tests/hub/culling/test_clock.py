"""decide() run every check interval on a simulated clock, as the hub-side service will run it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpulab.hub.culling import CullState, ServerObservation, decide
from tests.harness.culling import (
    DRY_RUN,
    LIVE,
    NOW,
    RULE,
    idle_server,
    idle_server_at,
    run_checks,
    series,
)

# the user stops typing and her GPU goes quiet at IDLE_FROM; busy before
IDLE_FROM = NOW


def gpu_idle_from(idle_from: float, t: float) -> ServerObservation:
    busy = series(idle_from - 3600, idle_from - 15, 80.0)
    quiet = series(idle_from, t, 1.0)
    return idle_server(
        started_at=idle_from - 3600,
        last_user_input_at=idle_from,
        slices={"GPU 0": busy + quiet},
    )


@pytest.mark.parametrize("interval", [60, 70, 180])
def test_an_idle_server_is_warned_then_culled_within_w_plus_one_check_interval(
    interval: int,
) -> None:
    decisions = run_checks(
        LIVE, lambda t: gpu_idle_from(IDLE_FROM, t), IDLE_FROM + 30, IDLE_FROM + 3 * 3600, interval
    )
    verdicts = [d.verdict for d in decisions]
    warn_at = decisions[verdicts.index("warn")].at
    cull = decisions[-1]
    assert cull.verdict == "cull" and cull.effect == "checkpoint-stop"
    # warned at the first check once both T (UI) and T_gpu (GPU) had passed
    needed = max(RULE.ui_idle_seconds, RULE.gpu_idle_seconds)
    assert IDLE_FROM + needed <= warn_at < IDLE_FROM + needed + interval + 15
    assert RULE.warn_seconds <= cull.at - warn_at <= RULE.warn_seconds + interval
    # between the warning and the cull only waiting, each naming the same deadline
    between = decisions[verdicts.index("warn") + 1 : -1]
    assert {d.verdict for d in between} <= {"wait"}
    assert {d.deadline for d in decisions if d.verdict != "keep"} == {warn_at + RULE.warn_seconds}
    assert [d.effect for d in decisions].count("warn") == 1


def test_input_during_the_warning_withdraws_it_and_the_next_warning_starts_afresh() -> None:
    typed_at = IDLE_FROM + 3600 + 300  # five minutes into the first warning

    def observe(t: float) -> ServerObservation:
        observation = gpu_idle_from(IDLE_FROM, t)
        if t >= typed_at:
            observation = replace(observation, last_user_input_at=typed_at)
        return observation

    decisions = run_checks(LIVE, observe, IDLE_FROM + 3600, IDLE_FROM + 4 * 3600, 60)
    first_warning = decisions[0]
    withdrawn = next(d for d in decisions if d.warning_withdrawn)
    second_warning = next(d for d in decisions if d.at > withdrawn.at and d.verdict == "warn")
    cull = decisions[-1]
    assert first_warning.verdict == "warn"
    assert (withdrawn.at, withdrawn.effect) == (typed_at, "withdraw-warning")
    assert withdrawn.reason == ("warning withdrawn: UI input 0 s ago (culling needs 1 h without)")
    assert second_warning.at == typed_at + RULE.ui_idle_seconds
    assert cull.verdict == "cull"
    assert RULE.warn_seconds <= cull.at - second_warning.at <= RULE.warn_seconds + 60


def test_a_dry_run_reports_the_same_decisions_and_carries_none_out() -> None:
    def observe(t: float) -> ServerObservation:
        return gpu_idle_from(IDLE_FROM, t)

    live = run_checks(LIVE, observe, IDLE_FROM + 30, IDLE_FROM + 3 * 3600, 60)
    dry = run_checks(DRY_RUN, observe, IDLE_FROM + 30, IDLE_FROM + 3 * 3600, 60)
    dry = dry[: len(live)]  # a dry run culls nobody, so it goes on deciding "cull"
    assert [(d.at, d.verdict, d.reason) for d in dry] == [(d.at, d.verdict, d.reason) for d in live]
    assert {d.effect for d in dry} == {"none"}
    assert dry[-1].would_cull and dry[-1].cull_action == "checkpoint-stop"


def test_a_dry_runs_simulated_warning_never_counts_once_the_policy_is_live() -> None:
    observation = idle_server()
    dry = decide(DRY_RUN, observation, CullState(), NOW)
    assert (dry.verdict, dry.effect, dry.state.warning_shown) == ("warn", "none", False)
    later = NOW + RULE.warn_seconds + 60
    live = decide(LIVE, idle_server_at(later), dry.state, later)
    # nobody saw the simulated warning: the user is warned now, and gets her full W
    assert (live.verdict, live.effect, live.deadline) == ("warn", "warn", later + RULE.warn_seconds)


def test_going_back_to_a_dry_run_withdraws_a_warning_shown_while_live() -> None:
    live = decide(LIVE, idle_server(), CullState(), NOW)
    dry = decide(DRY_RUN, idle_server_at(NOW + 60), live.state, NOW + 60)
    assert (dry.verdict, dry.effect) == ("wait", "withdraw-warning")
    assert dry.reason.endswith("(dry run: the warning shown earlier is withdrawn)")
    again = decide(DRY_RUN, idle_server_at(NOW + 120), dry.state, NOW + 120)
    assert (again.verdict, again.effect) == ("wait", "none")


def test_a_restarted_server_starts_without_the_old_runs_warning() -> None:
    warned = decide(LIVE, idle_server(), CullState(), NOW)
    later = NOW + RULE.warn_seconds
    restarted = idle_server_at(later, started_at=NOW + 10, last_user_input_at=None)
    decision = decide(LIVE, restarted, warned.state, later)
    assert decision.causes == ("ui-input",)  # a fresh run: no UI input for only 14 min 50 s
    assert (decision.warning_withdrawn, decision.effect) == (False, "none")


def test_a_failed_cull_is_decided_again_at_the_next_check() -> None:
    warned = decide(LIVE, idle_server(), CullState(), NOW)
    due = NOW + RULE.warn_seconds
    cull = decide(LIVE, idle_server_at(due), warned.state, due)
    retry = decide(LIVE, idle_server_at(due + 60), cull.state, due + 60)
    assert (cull.effect, retry.effect) == ("checkpoint-stop", "checkpoint-stop")
