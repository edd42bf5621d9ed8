"""The churn replay of bench.allocator (bench/_churn.py) on hand-made pods: FIFO waits, give-ups
and the time-weighted allocation ratio it reports; and bench.allocator's last line."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from bench import _churn
from bench import allocator as bench_allocator
from gpulab.hub.allocator import GPU, Inventory, Node, get_policy
from gpulab.hub.allocator.openb import TracePod


def _pod(name: str, arrival: int, duration: int, milli: int = 1000) -> _churn.TimedPod:
    pod = TracePod(name, 1000, 1024, 1, milli, frozenset())
    return _churn.TimedPod(pod, arrival, duration)


def test_a_pod_waits_for_the_gpu_a_departure_frees_and_a_late_one_gives_up():
    inventory = Inventory([Node("n", 8000, 65536, (GPU("g0", "A100"),))])
    pods = [
        _pod("a", 0, 10),
        _pod("b", 1, 20),  # waits for a: from 1 to 10, then runs to 30
        _pod("c", 2, 3),  # its own deletion (5) comes while it waits: gives up
        _pod("d", 4, 30, milli=500),  # waits for b: from 4 to 30
    ]
    result = _churn.replay_churn(inventory, pods, lambda: get_policy("best-fit", 0), "bf")
    assert result.placed == 3 and result.gave_up == 1
    assert sorted(result.waits) == [0, 9, 26]
    assert result.mean_ratio(_churn.arrival_window(pods)) == 100.0  # busy from 0 to 4
    assert result.mean_ratio((30, 40)) == 50.0  # d alone from 30 to 60
    assert result.samples((0, 40)) == [100.0, 100.0, 100.0, 50.0, 50.0]  # at 4, 10, 20, 30, 36
    assert result.waited == 2
    assert result.wait_p(0.5) == 9 and result.wait_p(0) == 0
    assert result.wait_p(0, waiters_only=True) == 9  # a pod placed on arrival never waited
    assert _churn.peak_demand(pods) == 3500  # a, b, c, d at once were every pod placed on arrival


def test_stretching_run_times_reaches_the_asked_pressure():
    pods = [_pod(f"p{i}", i, 1) for i in range(100)]  # one at a time, as given
    assert _churn.peak_demand(pods) == 1000
    longer = _churn.stretched(pods, capacity_milli=10_000, pressure=2.0)
    assert 19_000 <= _churn.peak_demand(longer) <= 21_000


def test_the_contended_window_starts_when_offered_demand_reaches_the_level():
    pods = [_pod("a", 0, 100), _pod("b", 10, 100), _pod("c", 20, 100), _pod("d", 50, 5)]
    assert _churn.contended_window(pods, capacity_milli=2000, level=0.5) == (0, 50)
    assert _churn.contended_window(pods, capacity_milli=2000, level=1.0) == (10, 50)
    assert _churn.contended_window(pods, capacity_milli=2000, level=2.0) == (50, 50)  # all four
    assert _churn.contended_window(pods, capacity_milli=2000, level=3.0) == (50, 50)  # never


@pytest.mark.slow
def test_the_benchmarks_last_line_carries_every_figure_as_a_number():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench_allocator.main(["--quick", "--seeds", "1", "--ilp", "0"])
    assert rc == 0, out.getvalue()  # calibration held
    text = out.getvalue()
    assert "**gpulab, shipped** (mix learnt online)" in text and "churn replay" in text
    fields = dict(item.split("=") for item in text.splitlines()[-1].split())
    assert list(fields) == [
        "default",
        "gpushare40",
        "multigpu50",
        "gpuspec33",
        "bestfit_default",
        "p99_ms",
        "online_default",
        "churn_alloc_vs_fgd",
        "synthetic_multigpu_vs_fgd",
    ]
    assert all(math.isfinite(float(v)) for v in fields.values())
    assert 0 < float(fields["online_default"]) <= 100
    assert -100 < float(fields["churn_alloc_vs_fgd"]) < 100
    assert -100 < float(fields["synthetic_multigpu_vs_fgd"]) < 100
