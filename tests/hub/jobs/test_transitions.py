"""The run state machine: every legal transition, the illegal ones, attempts and retries."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.jobs import (
    FINAL_STATES,
    HOLDING_STATES,
    PLATFORM_RETRIES,
    RETRYABLE_STATES,
    TRANSITIONS,
    Admit,
    Cancel,
    Fail,
    IllegalTransition,
    Preempt,
    Retry,
    RunState,
    Start,
    Succeed,
    TimeOut,
    allowed_events,
    transition,
)
from tests.harness.jobs import ALL_EVENTS, PLACEMENT, drive, make_event, new_run, run_in

LEGAL = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].__name__))
ILLEGAL = [
    (state, kind) for state in RunState for kind in ALL_EVENTS if (state, kind) not in TRANSITIONS
]


@pytest.mark.parametrize(
    ("pair", "target"), LEGAL, ids=[f"{s.value}-{k.__name__}" for (s, k), _ in LEGAL]
)
def test_every_transition_of_the_table_leads_where_the_table_says(pair, target):
    state, kind = pair
    run = run_in(state, max_retries=1)
    after = transition(run, make_event(kind, at=50.0))
    assert after.state is target
    assert after.version == run.version + 1
    assert after.updated_at == 50.0
    assert run.state is state  # values are immutable: the old run is unchanged


@pytest.mark.parametrize(
    ("state", "kind"), ILLEGAL, ids=[f"{s.value}-{k.__name__}" for s, k in ILLEGAL]
)
def test_every_pair_missing_from_the_table_is_refused_and_says_what_is_allowed(state, kind):
    run = run_in(state, max_retries=1)
    with pytest.raises(IllegalTransition) as caught:
        transition(run, make_event(kind))
    assert f"is {state.value}" in caught.value.reason
    assert kind.__name__ in caught.value.reason
    assert caught.value.run is run


def test_the_final_states_allow_nothing():
    for state in FINAL_STATES:
        run = run_in(state)
        assert allowed_events(run) == frozenset()
        assert run.is_terminal


def test_an_attempt_records_its_placement_start_end_and_exit_code():
    run = drive(new_run(), Admit, Start)
    run = transition(run, Fail(20.0, reason="exited with code 3", exit_code=3))
    (attempt,) = run.attempts
    assert attempt.number == 1
    assert attempt.placement == PLACEMENT
    assert (attempt.admitted_at, attempt.started_at, attempt.ended_at) == (1.0, 2.0, 20.0)
    assert attempt.outcome is RunState.FAILED
    assert attempt.exit_code == 3
    assert attempt.reason == run.reason == "exited with code 3"


def test_success_records_exit_code_zero():
    run = run_in(RunState.SUCCEEDED)
    assert run.attempt is not None
    assert (run.attempt.outcome, run.attempt.exit_code) == (RunState.SUCCEEDED, 0)


def test_a_timeout_says_the_limit_it_ran_past():
    run = drive(new_run(timeout_seconds=600), Admit, Start, TimeOut)
    assert run.reason == "ran longer than its limit of 600 s"
    assert run.attempt is not None and run.attempt.outcome is RunState.TIMED_OUT


def test_a_run_that_could_not_start_fails_its_attempt():
    run = transition(run_in(RunState.ADMITTED), Fail(5.0, reason="train.py not found"))
    assert run.state is RunState.FAILED
    assert run.attempt is not None and run.attempt.started_at is None
    assert run.attempt.outcome is RunState.FAILED


def test_canceling_a_queued_run_ends_no_attempt():
    run = transition(new_run(), Cancel(3.0, reason="canceled by alice"))
    assert run.state is RunState.CANCELED
    assert run.attempts == ()
    assert run.reason == "canceled by alice"


def test_canceling_a_running_run_ends_its_attempt_at_once():
    run = transition(run_in(RunState.RUNNING), Cancel(9.0, reason="canceled by alice"))
    assert run.attempt is not None
    assert (run.attempt.outcome, run.attempt.ended_at) == (RunState.CANCELED, 9.0)


def test_max_retries_allows_that_many_more_attempts_after_failures():
    run = new_run(max_retries=2)
    for number in (1, 2):
        run = drive(run, Admit, Start, Fail, Retry)
        assert run.state is RunState.QUEUED
        assert len(run.attempts) == number
        assert run.reason == f"queued again after attempt {number} (failed)"
    run = drive(run, Admit, Start, Fail)
    assert run.counted_attempts == 3
    assert not run.retry_allowed and run.is_terminal
    with pytest.raises(IllegalTransition, match="max_retries=2"):
        transition(run, Retry(99.0))


def test_timeouts_count_against_max_retries():
    run = drive(new_run(max_retries=1), Admit, Start, TimeOut, Retry, Admit, Start, TimeOut)
    assert run.counted_attempts == 2
    assert run.is_terminal


def test_preempted_attempts_do_not_count_against_max_retries():
    run = new_run(max_retries=0)
    for _ in range(5):
        run = drive(run, Admit, Start, Preempt)
        assert run.retry_allowed
        run = transition(run, Retry(50.0))
    assert run.counted_attempts == 0
    run = drive(run, Admit, Start, Fail)
    assert len(run.attempts) == 6
    assert run.counted_attempts == 1
    assert run.is_terminal  # max_retries=0: the one failure ends it, the preemptions did not


def platform_failure(at: float) -> Fail:
    return Fail(at, reason="failed before the job's code started: no kernel", platform_failure=True)


def test_platform_failures_do_not_count_against_max_retries_up_to_their_own_bound():
    run = new_run(max_retries=0)
    for number in range(1, PLATFORM_RETRIES + 1):
        run = transition(drive(run, Admit, Start), platform_failure(10.0 * number))
        assert run.attempt is not None and run.attempt.platform_failure
        assert run.counted_attempts == 0 and run.retry_allowed, number
        run = transition(run, Retry(10.0 * number + 1))
    run = transition(drive(run, Admit, Start), platform_failure(99.0))
    assert run.platform_failures == PLATFORM_RETRIES + 1
    assert run.counted_attempts == 1
    assert run.is_terminal  # a platform that never starts the job still ends its run


def test_lost_nodes_are_retried_without_counting_but_only_platform_retries_times():
    run = new_run(max_retries=0)
    for number in range(1, PLATFORM_RETRIES + 1):
        lost = Preempt(10.0 * number, reason=f"node n{number} was lost", platform_failure=True)
        run = transition(drive(run, Admit, Start), lost)
        assert run.state is RunState.PREEMPTED and run.attempt is not None
        assert run.attempt.platform_failure and run.counted_attempts == 0
        assert run.retry_allowed, number
        run = transition(run, Retry(10.0 * number + 1))
    lost = Preempt(99.0, reason="node n9 was lost", platform_failure=True)
    run = transition(drive(run, Admit, Start), lost)
    assert run.counted_attempts == 1 and run.is_terminal  # a job that keeps losing its node ends
    # a preemption for on-demand work is never the platform's failure: always retried
    run = new_run(max_retries=0)
    for number in range(1, PLATFORM_RETRIES + 3):
        run = transition(drive(run, Admit, Start), Preempt(10.0 * number))
        assert run.retry_allowed, number
        run = transition(run, Retry(10.0 * number + 1))


def test_the_jobs_own_failure_still_counts_after_platform_failures():
    run = new_run(max_retries=1)
    run = transition(transition(drive(run, Admit, Start), platform_failure(5.0)), Retry(6.0))
    run = drive(run, Admit, Start, Fail, Retry, Admit, Start, Fail, start_at=10.0)
    assert [a.platform_failure for a in run.attempts] == [True, False, False]
    assert run.counted_attempts == 2 and run.is_terminal


def test_a_run_waiting_for_its_retry_may_be_canceled_but_one_with_none_left_may_not():
    waiting = run_in(RunState.FAILED, max_retries=1)
    assert Cancel in allowed_events(waiting)
    assert transition(waiting, Cancel(7.0)).state is RunState.CANCELED
    over = run_in(RunState.FAILED, max_retries=0)
    assert allowed_events(over) == frozenset()
    with pytest.raises(IllegalTransition):
        transition(over, Cancel(7.0))


def test_the_deadline_is_the_attempts_start_plus_the_timeout():
    run = drive(new_run(timeout_seconds=60), Admit)
    assert run.deadline is None  # not started yet
    run = transition(run, Start(1000.0))
    assert run.deadline == 1060.0
    assert drive(new_run(), Admit, Start).deadline is None  # no limit


def test_allowed_events_is_what_transition_accepts():
    for state in RunState:
        for retries in (0, 1):
            run = run_in(state, max_retries=retries)
            for kind in ALL_EVENTS:
                try:
                    transition(run, make_event(kind))
                    accepted = True
                except IllegalTransition:
                    accepted = False
                assert accepted == (kind in allowed_events(run)), (state, retries, kind)


@given(
    max_retries=st.integers(0, 3),
    kinds=st.lists(st.sampled_from(ALL_EVENTS), max_size=40),
)
def test_any_sequence_of_events_keeps_the_attempts_consistent(max_retries, kinds):
    run = new_run(max_retries=max_retries)
    accepted = 0
    for step, kind in enumerate(kinds):
        if kind in allowed_events(run):
            run = transition(run, make_event(kind, at=float(step)))
            accepted += 1
        else:
            with pytest.raises(IllegalTransition):
                transition(run, make_event(kind, at=float(step)))
        assert [a.number for a in run.attempts] == list(range(1, len(run.attempts) + 1))
        open_attempts = [a for a in run.attempts if a.outcome is None]
        # an attempt is open exactly while the run holds its share
        assert len(open_attempts) == (1 if run.state in HOLDING_STATES else 0)
        if open_attempts:
            assert open_attempts[0] is run.attempts[-1]
        assert run.counted_attempts <= max_retries + 1
        if run.state in RETRYABLE_STATES:
            assert run.attempt is not None and run.attempt.outcome is run.state
        assert run.version == accepted  # grows by one per change, never on a refusal


def test_succeed_and_start_need_the_states_that_have_an_attempt():
    with pytest.raises(IllegalTransition):
        transition(new_run(), Start(1.0))
    with pytest.raises(IllegalTransition):
        transition(new_run(), Succeed(1.0))
    with pytest.raises(IllegalTransition):
        transition(new_run(), Preempt(1.0))
