"""Queue order, positions and the sentence that says why a run waits."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import GPU, Allocator, Inventory, Node, Quota, QuotaExceeded, Request
from gpulab.hub.jobs import (
    Admit,
    Preempt,
    Retry,
    Run,
    RunState,
    Start,
    WaitFacts,
    queue_order,
    queue_positions,
    quota_holder_short,
    quota_usage,
    share_label,
    waiting_reason,
)
from tests.harness.jobs import drive, make_spec, run_in


def queued(run_id: int, submitted_at: float, priority: int = 0) -> Run:
    return Run.submitted(run_id, run_id, make_spec(priority=priority), at=submitted_at)


def test_higher_priority_goes_first_then_the_earlier_submission():
    runs = [queued(1, 10.0), queued(2, 5.0), queued(3, 20.0, priority=5), queued(4, 1.0, -1)]
    assert [r.id for r in queue_order(runs)] == [3, 2, 1, 4]


def test_runs_submitted_in_the_same_instant_keep_their_submission_order():
    runs = [queued(7, 3.0), queued(5, 3.0), queued(6, 3.0)]
    assert [r.id for r in queue_order(runs)] == [5, 6, 7]


def test_only_queued_runs_are_in_the_queue():
    running = drive(queued(1, 0.0), Admit, Start)
    done = run_in(RunState.SUCCEEDED)
    assert [r.id for r in queue_order([running, done, queued(9, 5.0)])] == [9]


def test_a_preempted_and_retried_run_keeps_its_place_by_submission_time():
    first = drive(queued(1, 0.0), Admit, Start, Preempt, Retry, start_at=100.0)
    later = queued(2, 50.0)
    assert [r.id for r in queue_order([later, first])] == [1, 2]


def test_positions_count_from_one_in_queue_order():
    runs = [queued(1, 10.0), queued(2, 5.0), queued(3, 20.0, priority=1)]
    assert queue_positions(runs) == {3: 1, 2: 2, 1: 3}


@pytest.mark.parametrize(
    ("facts", "sentence"),
    [
        (WaitFacts(3, "1/4 GPU", fits_now=True), "waiting behind 3 runs"),
        (WaitFacts(1, "1/4 GPU", fits_now=True), "waiting behind 1 run"),
        (WaitFacts(0, "1/4 GPU", fits_now=False), "waiting for a free 1/4 GPU"),
        (WaitFacts(2, "2 GPUs", fits_now=False), "waiting for a free 2 GPUs (2 runs ahead)"),
        (
            WaitFacts(3, "1/4 GPU", fits_now=False, quota_short="group students"),
            "waiting for quota of group students",
        ),
        (WaitFacts(0, "1 GPU", fits_now=True), "next to be admitted"),
    ],
)
def test_the_waiting_reason_names_the_first_obstacle(facts, sentence):
    assert waiting_reason(facts) == sentence


@pytest.mark.parametrize(
    ("num_gpu", "gpu_milli", "label"),
    [(0, 250, "1/4 GPU"), (0, 125, "1/8 GPU"), (0, 300, "0.3 GPU"), (1, 0, "1 GPU")]
    + [(4, 0, "4 GPUs"), (0, 0, "CPU-only place")],
)
def test_share_labels_read_as_users_pick_profiles(num_gpu, gpu_milli, label):
    assert share_label(num_gpu, gpu_milli) == label


def test_the_short_budget_is_the_users_own_first_then_groups_by_name():
    quota = Quota(users={"alice": 1000}, groups={"students": 2000, "a-lab": 500})
    groups = {"students", "a-lab"}
    assert quota_holder_short(quota, "alice", groups, 250, 0, {}) is None
    assert quota_holder_short(quota, "alice", groups, 250, 800, {}) == "user alice"
    assert quota_holder_short(quota, "alice", groups, 250, 0, {"a-lab": 300}) == "group a-lab"
    assert (
        quota_holder_short(quota, "alice", groups, 250, 0, {"students": 1900}) == "group students"
    )
    assert quota_holder_short(quota, "alice", groups, 0, 5000, {}) is None  # CPU-only


def test_the_short_budget_named_is_the_one_the_allocator_refuses_for():
    quota = Quota(groups={"students": 1000}, default_user_milli=4000)
    node = Node(
        "a1", 64_000, 262_144, gpus=tuple(GPU(f"a1-gpu{i}", "A100", index=i) for i in range(4))
    )
    alloc = Allocator(Inventory([node]), quota=quota)
    students = frozenset({"students"})
    alloc.place(Request("alice/nb", owner="alice", groups=students, gpu_milli=750))
    alloc.place(
        Request("bob/spot", owner="bob", groups=students, gpu_milli=500, priority="preemptible")
    )
    bob = Request("bob/job", owner="bob", groups=students, gpu_milli=500)
    with pytest.raises(QuotaExceeded, match="Group 'students'"):
        alloc.place(bob)
    users, groups = quota_usage(alloc.allocations())
    assert groups == {"students": 750}  # the over-quota spot share is not counted
    short = quota_holder_short(quota, "bob", bob.groups, 500, users.get("bob", 0), groups)
    reason = waiting_reason(
        WaitFacts(0, share_label(gpu_milli=500), alloc.capacity(bob) > 0, short)
    )
    assert reason == "waiting for quota of group students"
