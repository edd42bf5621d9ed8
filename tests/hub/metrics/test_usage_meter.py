"""What gpulab-metrics makes of pushes for the ledger: GPU-seconds used, slices' GPU-idle time."""

from __future__ import annotations

from gpulab.hub.alerts import Sample
from gpulab.hub.services.metrics.usage import LiveSlices, UsageMeter


def test_used_seconds_are_utilisation_times_the_time_between_pushes_capped_at_the_gap():
    meter = UsageMeter(max_gap_seconds=30)
    meter.observe("a", "", {"g0": Sample(t=7200.0, utilization_pct=50)})  # the first: no stretch
    meter.observe("a", "", {"g0": Sample(t=7210.0, utilization_pct=50)})
    meter.observe("a", "", {"g0": Sample(t=7310.0, utilization_pct=100)})  # 100 s gap: 30 count
    meter.observe("a", "", {"g0": Sample(t=7320.0, utilization_pct=None)})  # no figure: nothing
    (sample,) = meter.take()
    assert (sample.user, sample.device, sample.hour) == ("a", "g0", 7200)
    assert (sample.used_gpu_seconds, sample.sampled_seconds) == (5.0 + 30.0, 10.0 + 30.0)
    assert meter.take() == []
    meter.give_back([sample])
    assert meter.take() == [sample]
    meter.forget("a", "")  # a stopped server: its restart starts a new stretch
    meter.observe("a", "", {"g0": Sample(t=9000.0, utilization_pct=100)})
    assert meter.take() == []


def test_a_slice_is_gpu_idle_from_its_first_quiet_push_until_a_busy_one_or_a_gap():
    live = LiveSlices(idle_pct=5, max_gap_seconds=30)
    live.observe("a", "", {"g0": Sample(t=100.0, utilization_pct=3)})
    live.observe("a", "", {"g0": Sample(t=110.0, utilization_pct=0)})
    (fig,), gone = live.take()
    assert fig.below_since == 100.0 and gone == []
    live.observe("a", "", {"g0": Sample(t=120.0, utilization_pct=40)})
    (fig,), _ = live.take()
    assert fig.below_since is None
    live.observe("a", "", {"g0": Sample(t=130.0, utilization_pct=1)})
    live.observe("a", "", {"g0": Sample(t=200.0, utilization_pct=1)})  # a 70 s gap: counts anew
    (fig,), _ = live.take()
    assert fig.below_since == 200.0
    live.observe("a", "", {"g0": Sample(t=210.0, utilization_pct=None)})  # unknown is not idle
    (fig,), _ = live.take()
    assert fig.below_since is None
    live.forget("a", "")
    assert live.take() == ([], [("a", "")])
