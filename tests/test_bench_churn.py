"""The churn replay of bench.allocator (bench/_churn.py) on hand-made pods: FIFO waits, give-ups
and the time-weighted allocation ratio it reports."""

from __future__ import annotations

from bench import _churn
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
    assert result.mean_ratio == 100.0  # the GPU was busy over the whole arrival window (0..4)
    assert _churn.peak_demand(pods) == 3500  # a, b, c, d at once were every pod placed on arrival


def test_stretching_run_times_reaches_the_asked_pressure():
    pods = [_pod(f"p{i}", i, 1) for i in range(100)]  # one at a time, as given
    assert _churn.peak_demand(pods) == 1000
    longer = _churn.stretched(pods, capacity_milli=10_000, pressure=2.0)
    assert 19_000 <= _churn.peak_demand(longer) <= 21_000
