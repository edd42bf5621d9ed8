"""The interval rule (`diff`) and the exact arithmetic of allocated GPU-hours."""

from __future__ import annotations

import pytest

from gpulab.hub.allocator import Request
from gpulab.hub.ledger import (
    NODE_LOST,
    PREEMPTED,
    RELEASED,
    RESIZED,
    DeviceInfo,
    Holding,
    Interval,
    RollupError,
    UsageSample,
    diff,
    holdings,
    rollup,
    whole_second,
    workload_of,
)
from gpulab.hub.ledger.store import LiveFigure, figures_of_shares


def holding(aid: str = "alice/", device: str = "gpu-0", milli: int = 250, **kw: object) -> Holding:
    fields: dict[str, object] = {
        "allocation_id": aid,
        "device": device,
        "user": aid.split("/")[0],
        "groups": ("ml",),
        "workload": "server",
        "profile": "quarter",
        "gpu_model": "A100",
        "mig_profile": None,
        "node": "n1",
        "milli": milli,
        "tier": "on-demand",
    }
    fields.update(kw)
    return Holding(**fields)  # type: ignore[arg-type]


def test_four_quarter_shares_for_an_hour_are_exactly_one_gpu_hour():
    intervals = [Interval(i, holding(f"u{i}/", milli=250), start=7200, end=10800) for i in range(4)]
    rows = rollup(intervals, [], since=0, until=86400, bucket="day", by=())
    assert len(rows) == 1
    assert rows[0].allocated_gpu_hours == 1.0
    assert rows[0].allocated_milli_seconds == 1000 * 3600


def test_an_interval_is_split_across_hours_days_and_months_without_loss():
    # 2026-01-31 23:30 UTC to 2026-02-01 00:30: half an hour in each month
    start = 1769902200
    interval = Interval(1, holding(milli=1000), start=start, end=start + 3600)
    months = rollup([interval], [], since=start - 86400, until=start + 86400, bucket="month")
    assert [r.allocated_gpu_hours for r in months] == [0.5, 0.5]
    hours = rollup([interval], [], since=start, until=start + 7200, bucket="hour")
    assert [r.allocated_gpu_hours for r in hours] == [0.5, 0.5]


def test_a_window_clips_open_and_closed_intervals():
    intervals = [
        Interval(1, holding("a/"), start=0, end=None),
        Interval(2, holding("b/", milli=1000), start=1800, end=5400),
    ]
    rows = rollup(intervals, [], since=3600, until=7200, bucket="hour", by=("user",))
    assert {r.key: r.allocated_gpu_hours for r in rows} == {("a",): 0.25, ("b",): 0.5}


def test_group_rollups_count_an_interval_for_each_group():
    interval = Interval(1, holding(groups=("ml", "vision"), milli=500), start=0, end=3600)
    rows = rollup([interval], [], since=0, until=3600, bucket="hour", by=("group",))
    assert {r.key: r.allocated_gpu_hours for r in rows} == {("ml",): 0.5, ("vision",): 0.5}


def test_used_is_capped_at_allocated_and_idle_is_the_rest():
    interval = Interval(1, holding("alice/", milli=250), start=0, end=3600)
    # the device-wide figure of a quarter share counts its neighbours' work too: 0.9 GPU-hours
    usage = [
        UsageSample("alice", "", "gpu-0", 0, used_gpu_seconds=0.9 * 3600, sampled_seconds=3600)
    ]
    (row,) = rollup([interval], usage, since=0, until=3600, bucket="hour", by=("user",))
    assert row.used_gpu_hours == 0.25
    assert row.idle_gpu_hours == 0.0
    usage = [UsageSample("alice", "", "gpu-0", 0, used_gpu_seconds=360, sampled_seconds=3600)]
    (row,) = rollup([interval], usage, since=0, until=3600, bucket="hour", by=("user",))
    assert row.used_gpu_hours == 0.1
    assert row.idle_gpu_hours == pytest.approx(0.15)


def test_job_and_dask_use_comes_from_their_own_reports_and_a_servers_never_lands_on_them():
    # alice's server holds a quarter of gpu-0; her job run and her Dask worker hold the other
    # three quarters of it, for the same hour; the job reports, the worker does not (yet)
    intervals = [
        Interval(1, holding("alice/", milli=250), start=0, end=3600),
        Interval(2, holding("alice/job-7", milli=500, workload="job"), start=0, end=3600),
        Interval(3, holding("alice/dask-1-w0", milli=250, workload="dask"), start=0, end=3600),
    ]
    # the server's monitor saw more than its quarter used (device-wide figure): capped at its
    # own quarter, never spilled onto the job's or the worker's hours; the job's own report
    # counts for the job only, capped at its half
    usage = [
        UsageSample("alice", "", "gpu-0", 0, used_gpu_seconds=0.9 * 3600, sampled_seconds=3600),
        UsageSample(
            "alice", "job-7", "gpu-0", 0, used_gpu_seconds=0.4 * 3600, sampled_seconds=3600
        ),
    ]
    (row,) = rollup(intervals, usage, since=0, until=3600, bucket="hour", by=("user",))
    assert row.allocated_gpu_hours == 1.0
    assert row.unmonitored_gpu_hours == 0.0
    assert row.used_gpu_hours == pytest.approx(0.65)
    assert row.idle_gpu_hours == pytest.approx(0.35)
    by_workload = rollup(intervals, usage, since=0, until=3600, bucket="hour", by=("workload",))
    assert {
        r.key: (r.allocated_gpu_hours, r.unmonitored_gpu_hours, r.used_gpu_hours, r.idle_gpu_hours)
        for r in by_workload
    } == {
        ("server",): (0.25, 0.0, 0.25, 0.0),
        ("job",): (0.5, 0.0, pytest.approx(0.4), pytest.approx(0.1)),
        ("dask",): (0.25, 0.0, 0.0, 0.25),
    }


def test_external_pods_hours_are_unmonitored_not_idle():
    intervals = [
        Interval(1, holding("ops/", milli=1000, workload="external"), start=0, end=3600),
        Interval(2, holding("alice/", milli=250, device="gpu-1"), start=0, end=3600),
    ]
    (row,) = rollup(intervals, [], since=0, until=3600, bucket="hour", by=())
    assert (row.allocated_gpu_hours, row.unmonitored_gpu_hours) == (1.25, 1.0)
    assert (row.used_gpu_hours, row.idle_gpu_hours) == (0.0, 0.25)


def test_a_job_takes_only_its_own_reports_never_a_servers_guessed_share():
    interval = Interval(1, holding("bob/job-3", milli=1000, workload="job"), start=0, end=3600)
    # a sample of bob's server on the device his job holds (no server interval there), and one
    # of another job of his: neither is this job's
    usage = [
        UsageSample("bob", "", "gpu-0", 0, used_gpu_seconds=1800, sampled_seconds=3600),
        UsageSample("bob", "job-4", "gpu-0", 0, used_gpu_seconds=1800, sampled_seconds=3600),
    ]
    (row,) = rollup([interval], usage, since=0, until=3600, bucket="hour", by=("user",))
    assert (row.allocated_gpu_hours, row.unmonitored_gpu_hours) == (1.0, 0.0)
    assert (row.used_gpu_hours, row.idle_gpu_hours) == (0.0, 1.0)
    usage.append(
        UsageSample("bob", "job-3", "gpu-0", 0, used_gpu_seconds=900, sampled_seconds=3600)
    )
    (row,) = rollup([interval], usage, since=0, until=3600, bucket="hour", by=("user",))
    assert (row.used_gpu_hours, row.idle_gpu_hours) == (0.25, 0.75)


def test_usage_of_someone_elses_device_or_of_a_workload_without_a_share_is_not_counted():
    interval = Interval(1, holding("alice/"), start=0, end=3600)
    usage = [
        UsageSample("bob", "", "gpu-0", 0, 100.0, 3600),  # bob has no share here
        UsageSample("alice", "job-9", "gpu-7", 0, 100.0, 3600),  # no share of that run's
    ]
    (row,) = rollup([interval], usage, since=0, until=3600, bucket="hour", by=("user",))
    assert row.used_gpu_seconds == 0.0


def test_a_pods_physical_devices_fill_its_own_slots():
    # on Kubernetes the allocator holds slots ("n1/gpu-0"); the pod's monitor names the physical
    # devices the device plugin gave it: its own samples go to its own intervals, up to each's room
    intervals = [
        Interval(1, holding("alice/job-3", device="n1/gpu-0", milli=1000, workload="job"), 0, 3600),
        Interval(2, holding("alice/job-3", device="n1/gpu-1", milli=1000, workload="job"), 0, 3600),
        Interval(3, holding("bob/", device="n1/gpu-2", milli=1000), 0, 3600),
    ]
    usage = [
        UsageSample("alice", "job-3", "GPU-aaaa", 0, used_gpu_seconds=3000, sampled_seconds=3600),
        UsageSample("alice", "job-3", "GPU-bbbb", 0, used_gpu_seconds=3000, sampled_seconds=3600),
        UsageSample("carol", "job-3", "GPU-cccc", 0, used_gpu_seconds=3000, sampled_seconds=3600),
    ]
    rows = rollup(intervals, usage, since=0, until=3600, bucket="hour", by=("user",))
    assert {r.key: r.used_gpu_seconds for r in rows} == {("alice",): 6000.0, ("bob",): 0.0}


def test_usage_goes_to_the_servers_own_allocation_first():
    own = Interval(1, holding("alice/big", profile="big"), start=0, end=3600)
    other = Interval(2, holding("alice/job-3", profile="small", workload="job"), start=0, end=3600)
    usage = [UsageSample("alice", "big", "gpu-0", 0, 600.0, 3600)]
    rows = rollup([other, own], usage, since=0, until=3600, bucket="hour", by=("profile",))
    assert {r.key: r.used_gpu_seconds for r in rows} == {("big",): 600.0, ("small",): 0.0}


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"bucket": "week"}, "bucket"), ({"by": ("colour",)}, "by"), ({"by": ("user", "user")}, "by")],
)
def test_a_rollup_names_the_field_it_cannot_read(kw: dict, field: str):
    with pytest.raises(RollupError, match=field):
        rollup([], [], since=0, until=10, **kw)
    with pytest.raises(RollupError, match="until"):
        rollup([], [], since=10, until=10)


def test_diff_closes_with_the_reason_of_the_change_and_opens_what_is_new():
    a, b, c = holding("a/"), holding("b/"), holding("c/", device="gpu-1")
    open_ = [Interval(1, a, 100), Interval(2, b, 100)]
    change = diff(open_, [a, c], 200, reasons={"b/": PREEMPTED})
    assert change.close == ((2, 200, PREEMPTED),)
    assert change.open == ((c, 200),)
    assert not diff(open_, [a, b], 300)


def test_a_resized_share_closes_and_reopens_and_a_lost_node_says_so():
    a = holding("a/", milli=250)
    bigger = holding("a/", milli=500)
    change = diff([Interval(1, a, 100)], [bigger], 160)
    assert change.close == ((1, 160, RESIZED),)
    assert change.open == ((bigger, 160),)
    gone = diff([Interval(1, a, 100)], [], 170, live_nodes=frozenset({"n2"}))
    assert gone.close == ((1, 170, NODE_LOST),)
    released = diff([Interval(1, a, 100)], [], 170, live_nodes=frozenset({"n1"}))
    assert released.close == ((1, 170, RELEASED),)


def test_a_holding_found_after_a_restart_opens_at_its_grant_not_at_the_restart():
    a = holding("a/")
    change = diff([], [a], 5000, started={"a/": 4100.4})
    assert change.open == ((a, 4100),)
    # a grant time in the future of the write (clock skew) never makes a negative stretch
    assert diff([], [a], 5000, started={"a/": 9000.0}).open == ((a, 5000),)


def test_a_group_change_is_not_a_new_interval():
    a = holding("a/", groups=("ml",))
    assert not diff([Interval(1, a, 0)], [holding("a/", groups=("ml", "new"))], 10)


def test_holdings_of_a_placement_one_per_device_with_the_inventorys_model():
    request = Request("alice/job-4", owner="alice", groups=frozenset({"ml"}), num_gpu=2)
    devices = {"g0": DeviceInfo("H100"), "g1": DeviceInfo("A100", mig_profile="3g.40gb")}
    found = holdings("alice/job-4", request, "n1", [("g0", 1000), ("g1", 1000)], devices.get)
    assert [(h.device, h.gpu_model, h.mig_profile, h.milli, h.workload) for h in found] == [
        ("g0", "H100", None, 1000, "job"),
        ("g1", "A100", "3g.40gb", 1000, "job"),
    ]
    labelled = Request("alice/x", owner="alice", gpu_milli=250, profile="q", workload="dask")
    (h,) = holdings("alice/x", labelled, "n1", [("gone", 250)], devices.get)
    assert (h.profile, h.workload, h.gpu_model, h.tier) == ("q", "dask", "unknown", "on-demand")


@pytest.mark.parametrize(
    ("aid", "kind"),
    [
        ("a/job-12", "job"),
        ("a/dask-3-w1", "dask"),
        ("external/ns/pod", "external"),
        ("a/", "server"),
        ("a/job-x", "server"),
    ],
)
def test_workload_from_an_unlabelled_allocation_id(aid: str, kind: str):
    assert workload_of(aid, None) == kind


def test_whole_seconds_round_to_nearest():
    assert (whole_second(10.49), whole_second(10.5), whole_second(10.6)) == (10, 11, 11)


def _figure(device: str, pct: float) -> LiveFigure:
    return LiveFigure("alice", "job-3", device, 10.0, pct, 100.0, 1000.0, None, 5.0)


def test_a_workloads_figures_are_matched_to_its_shares_by_name_then_by_count():
    same = {"gpu-0": _figure("gpu-0", 10), "gpu-1": _figure("gpu-1", 20)}
    assert [f and f.utilization_pct for f in figures_of_shares(["gpu-1", "gpu-0"], same)] == [
        20,
        10,
    ]
    # Kubernetes: slots in the allocator, physical devices in the pod
    physical = {"MIG-b": _figure("MIG-b", 30), "MIG-a": _figure("MIG-a", 40)}
    matched = figures_of_shares(["n1/mig-1g-0", "n1/mig-1g-1"], physical)
    assert [f and f.device for f in matched] == ["MIG-a", "MIG-b"]
    # a figure missing: no guessing which slot lacks it
    assert figures_of_shares(["n1/gpu-0", "n1/gpu-1"], {"GPU-x": _figure("GPU-x", 1)}) == [
        None,
        None,
    ]
    assert figures_of_shares(["gpu-0"], {}) == [None]


def test_use_of_an_open_interval_is_capped_at_what_it_held_until_the_rollups_end():
    # a job held a quarter for 8 s so far (still open); its report already says 4 s were used
    interval = Interval(1, holding("alice/job-1", milli=250, workload="job"), start=100)
    usage = [UsageSample("alice", "job-1", "gpu-0", 0, used_gpu_seconds=4.0, sampled_seconds=7)]
    (row,) = rollup([interval], usage, since=0, until=108, bucket="hour", by=())
    assert row.allocated_milli_seconds == 2000
    assert row.used_gpu_seconds == 2.0  # a quarter of 8 s, not of the rest of the hour
