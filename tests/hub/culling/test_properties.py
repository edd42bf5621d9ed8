"""Invariants of decide() over random servers, histories and rules (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpulab.hub.culling import (
    CULL_ACTIONS,
    EXEMPTIONS,
    CullConfigError,
    CullPolicy,
    CullRule,
    CullState,
    Decision,
    ServerObservation,
    SliceSample,
    SliceSummary,
    advance,
    decide,
    summarize_round,
)
from tests.harness.culling import NOW, PUSH_SECONDS

ACTING_EFFECTS = {"warn", *CULL_ACTIONS}

rules = st.builds(
    CullRule,
    ui_idle_seconds=st.integers(60, 900),
    gpu_utilization_pct=st.sampled_from([1.0, 5.0, 10.0]),
    gpu_idle_seconds=st.integers(60, 900),
    warn_seconds=st.integers(0, 600),
    action=st.sampled_from(CULL_ACTIONS),
)
policies = st.builds(
    lambda rule, dry_run: CullPolicy(default=rule, dry_run=dry_run), rules, st.booleans()
)


@dataclass(frozen=True)
class Step:
    """What happens on the server during one check interval."""

    seconds: int
    typed: bool
    gpu_pct: float | None  # every push in the interval reads this; None: the monitor is silent
    busy_kernels: int
    running_jobs: int
    dask_tasks: int
    keep_alive: bool


def rarely(value: Any, default: Any) -> st.SearchStrategy[Any]:
    """``value`` one time in ten: most histories must reach a warning and a cull."""
    return st.sampled_from([default] * 9 + [value])


steps = st.builds(
    Step,
    seconds=st.integers(1, 400),
    typed=rarely(True, False),
    gpu_pct=st.sampled_from([0.0, 2.0, 2.0, 2.0, 60.0, None]),
    busy_kernels=rarely(1, 0),
    running_jobs=rarely(2, 0),
    dask_tasks=rarely(5, 0),
    keep_alive=rarely(True, False),
)


def simulate(policy: CullPolicy, history: list[Step]) -> list[tuple[Decision, Step]]:
    """Checks after each step; the GPU pushes every 15 s and is summarised incrementally, as a
    service that keeps one SliceSummary per slice would."""
    rule = policy.default
    start = NOW
    t, last_input = start, None
    summary = SliceSummary(rule.gpu_utilization_pct)
    state, out = CullState(), []
    next_push = start
    for step in history:
        t += step.seconds
        while step.gpu_pct is not None and next_push <= t:
            sample = SliceSample(next_push, step.gpu_pct, "own_processes")
            summary = advance(summary, sample, policy.stale_sample_seconds)
            next_push += PUSH_SECONDS
        if step.gpu_pct is None:
            next_push = t + PUSH_SECONDS
        if step.typed:
            last_input = t
        observation = ServerObservation(
            user="alice",
            server="",
            profile="gpu-quarter",
            held_milli=250,
            started_at=start,
            last_user_input_at=last_input,
            slices={"GPU 0": summary},
            busy_kernels=step.busy_kernels,
            running_jobs=step.running_jobs,
            dask_tasks=step.dask_tasks,
            keep_alive_until=t + 3600 if step.keep_alive else None,
        )
        decision = decide(policy, observation, state, t)
        out.append((decision, step))
        state = decision.state
    return out


@settings(max_examples=300, deadline=None)
@given(policies, st.lists(steps, min_size=1, max_size=60))
def test_no_cull_without_a_warning_at_least_w_earlier_that_stayed_valid(
    policy: CullPolicy, history: list[Step]
) -> None:
    decisions = [d for d, _ in simulate(policy, history)]
    for i, decision in enumerate(decisions):
        if decision.verdict != "cull":
            continue
        # the warning: the latest decision before that was neither waiting nor (a retried) cull
        warning = next(d for d in reversed(decisions[:i]) if d.verdict not in ("wait", "cull"))
        assert warning.verdict == "warn"
        assert decision.at - warning.at >= policy.default.warn_seconds
        assert decision.deadline == warning.deadline
        if not policy.dry_run:
            assert warning.effect == "warn"


@settings(max_examples=300, deadline=None)
@given(policies, st.lists(steps, min_size=1, max_size=60))
def test_never_culled_or_warned_while_an_exemption_holds(
    policy: CullPolicy, history: list[Step]
) -> None:
    for decision, step in simulate(policy, history):
        if step.busy_kernels or step.running_jobs or step.dask_tasks or step.keep_alive:
            assert decision.verdict == "exempt"
            assert set(decision.causes) <= set(EXEMPTIONS)
            assert decision.effect in ("none", "withdraw-warning")


@settings(max_examples=300, deadline=None)
@given(rules, st.lists(steps, min_size=1, max_size=60))
def test_a_dry_run_never_hands_the_caller_a_warning_or_a_cull(
    rule: CullRule, history: list[Step]
) -> None:
    decided = simulate(CullPolicy(default=rule, dry_run=True), history)
    assert not {d.effect for d, _ in decided} & ACTING_EFFECTS
    summary = summarize_round(d for d, _ in decided)
    assert summary.dry_run and summary.text().startswith("would cull")


@settings(max_examples=300, deadline=None)
@given(rules, st.lists(steps, min_size=1, max_size=60))
def test_a_dry_run_decides_exactly_what_the_live_policy_decides(
    rule: CullRule, history: list[Step]
) -> None:
    live = simulate(CullPolicy(default=rule, dry_run=False), history)
    dry = simulate(CullPolicy(default=rule, dry_run=True), history)
    # the same verdicts and reasons up to the live policy's first cull (after it, the live
    # server is gone while the dry run's goes on)
    for (live_decision, _), (dry_decision, _) in zip(live, dry, strict=True):
        assert (dry_decision.verdict, dry_decision.reason) == (
            live_decision.verdict,
            live_decision.reason,
        )
        if live_decision.verdict == "cull":
            break


slice_samples = st.lists(
    st.builds(
        SliceSample,
        t=st.floats(NOW - 7200, NOW, allow_nan=False),
        utilization_pct=st.none() | st.floats(0, 100, allow_nan=False),
        scope=st.sampled_from(["device", "own_processes"]),
    ),
    max_size=20,
)
observations = st.builds(
    ServerObservation,
    user=st.just("alice"),
    server=st.sampled_from(["", "train"]),
    profile=st.sampled_from(["gpu-full", "gpu-quarter", ""]),
    held_milli=st.sampled_from([0, 125, 250, 1000, 2000]),
    started_at=st.floats(NOW - 10 * 3600, NOW, allow_nan=False),
    last_user_input_at=st.none() | st.floats(NOW - 10 * 3600, NOW, allow_nan=False),
    slices=st.dictionaries(st.sampled_from(["GPU 0", "GPU 1", "MIG 2"]), slice_samples, max_size=3),
    busy_kernels=st.integers(0, 3),
    running_jobs=st.integers(0, 3),
    dask_tasks=st.integers(0, 3),
    keep_alive_until=st.none() | st.floats(NOW - 3600, NOW + 3600, allow_nan=False),
)
states = st.builds(
    CullState,
    warned_at=st.none() | st.floats(NOW - 3600, NOW, allow_nan=False),
    warning_shown=st.booleans(),
    server_started_at=st.none(),
)


@settings(max_examples=300, deadline=None)
@given(policies, observations, states)
def test_decisions_are_deterministic_and_independent_of_slice_order(
    policy: CullPolicy, observation: ServerObservation, state: CullState
) -> None:
    first = decide(policy, observation, state, NOW)
    assert decide(policy, observation, state, NOW) == first
    reordered = dict(reversed(list(observation.slices.items())))
    assert decide(policy, replace(observation, slices=reordered), state, NOW) == first
    assert first.reason and first.causes


@settings(max_examples=300, deadline=None)
@given(policies, observations, states)
def test_a_server_holding_no_gpu_is_never_warned_or_culled(
    policy: CullPolicy, observation: ServerObservation, state: CullState
) -> None:
    decision = decide(policy, observation, state, NOW)
    if observation.held_milli == 0:
        assert (decision.verdict, decision.causes) == ("exempt", ("no-gpu",))


config_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**7) | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
rule_keys = st.sampled_from(
    [
        "ui_idle_seconds",
        "gpu_utilization_pct",
        "gpu_idle_seconds",
        "warn_seconds",
        "keep_alive_seconds",
        "action",
        "enabled",
        "typo",
    ]
)


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["default", "profiles", "dry_run", "stale_sample_seconds", "other"]),
        config_values
        | st.dictionaries(rule_keys, config_values, max_size=4)
        | st.dictionaries(
            st.text(max_size=4), st.dictionaries(rule_keys, config_values, max_size=3)
        ),
        max_size=4,
    )
)
def test_the_config_parser_refuses_only_with_cull_config_errors(config: dict[str, Any]) -> None:
    try:
        policy = CullPolicy.from_config(config)
    except CullConfigError as e:
        assert e.field and e.message
    else:
        assert CullPolicy.from_config(policy.to_dict()) == policy
