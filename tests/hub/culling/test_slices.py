"""Per-slice idleness: runs below the threshold, gaps, scopes, and summaries kept incrementally."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulab.hub.culling import SliceSample, SliceSummary, advance, summarize
from gpulab.hub.culling.slices import duration, judge_slice
from tests.harness.culling import NOW, series

GAP = 120


def test_the_idle_run_starts_at_the_first_sample_after_the_last_busy_one() -> None:
    summary = summarize(series(0, 600, 50.0) + series(615, 1200, 1.0), 5.0, GAP)
    assert (summary.below_since, summary.last_sample_at, summary.latest_pct) == (615, 1200, 1.0)


def test_a_sample_at_the_threshold_is_not_below_it() -> None:
    summary = summarize(series(0, 600, 1.0) + (SliceSample(615, 5.0),), 5.0, GAP)
    assert summary.below_since is None


def test_an_unmeasurable_sample_ends_the_idle_run() -> None:
    summary = summarize(series(0, 600, 1.0) + (SliceSample(615, None),), 5.0, GAP)
    assert (summary.below_since, summary.latest_pct) == (None, None)


def test_a_gap_longer_than_the_limit_restarts_the_run() -> None:
    summary = summarize(series(0, 600, 1.0) + series(600 + GAP + 1, 1200, 1.0), 5.0, GAP)
    assert summary.below_since == 600 + GAP + 1


def test_a_late_or_repeated_sample_is_ignored() -> None:
    summary = summarize(series(0, 600, 1.0), 5.0, GAP)
    assert advance(summary, SliceSample(600, 90.0), GAP) == summary
    assert advance(summary, SliceSample(300, 90.0), GAP) == summary


def test_a_device_figure_below_the_threshold_proves_a_fraction_idle() -> None:
    # the share's own work is part of the device's: a quiet device means a quiet share
    status = judge_slice(
        "GPU 0",
        series(NOW - 3600, NOW, 1.0, scope="device"),
        threshold_pct=5.0,
        idle_seconds_needed=1800,
        stale_seconds=GAP,
        fractional=True,
        now=NOW,
    )
    assert (status.idleness, status.detail) == ("idle", "GPU 0 below 5% for 1 h")


def test_a_summary_against_another_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="summarised against 10% but the rule's threshold is 5%"):
        judge_slice(
            "GPU 0",
            SliceSummary(10.0, NOW, NOW - 3600, 1.0),
            threshold_pct=5.0,
            idle_seconds_needed=1800,
            stale_seconds=GAP,
            fractional=False,
            now=NOW,
        )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (59.9, "59 s"),
        (60, "1 min"),
        (3599, "59 min"),
        (3600, "1 h"),
        (7500, "2 h 5 min"),
    ],
)
def test_durations_read_as_people_say_them_rounded_down(seconds: float, text: str) -> None:
    assert duration(seconds) == text


samples = st.lists(
    st.builds(
        SliceSample,
        t=st.integers(0, 5000).map(float),
        utilization_pct=st.none() | st.sampled_from([0.0, 4.9, 5.0, 80.0]),
    ),
    max_size=40,
)


@settings(max_examples=300)
@given(samples)
def test_an_incremental_summary_equals_one_over_the_whole_window(window: list[SliceSample]) -> None:
    ordered = sorted(window, key=lambda s: s.t)
    incremental = SliceSummary(5.0)
    for sample in ordered:
        incremental = advance(incremental, sample, GAP)
    assert incremental == summarize(window, 5.0, GAP)
