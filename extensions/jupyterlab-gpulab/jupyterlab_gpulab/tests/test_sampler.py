"""The sampler: one read of every device per period, however many panels listen."""

from __future__ import annotations

import asyncio
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from jupyterlab_gpulab.fanout import CHUNK, Fanout, Subscriber, clamp_rate
from jupyterlab_gpulab.sampler import Sampler
from jupyterlab_gpulab.share import Share
from jupyterlab_gpulab.sources import Latencies, SimulatedSource, spend

FREE = Latencies(utilization=0, memory=0, processes=0)


def share(uuids: tuple[str, ...] = (), **kw: object) -> Share:
    base = dict(
        uuids=uuids,
        memory_limit_mib=None,
        fraction=None,
        enforcement="exclusive",
        profile="p",
        user="u",
        server="",
    )
    base.update(kw)
    return Share(**base)  # type: ignore[arg-type]


def test_each_device_is_read_once_per_sample_with_fifty_subscribers() -> None:
    source = SimulatedSource(share(), device_count=8, latencies=FREE)
    fanout = Fanout()
    received: list[list[str]] = [[] for _ in range(50)]
    for box in received:
        fanout.add(Subscriber(box.append, rate_hz=20, period_seconds=1.0))
    clock = iter(float(t) for t in range(100, 200))
    sampler = Sampler(
        source, 1.0, 60, lambda s: fanout.publish_sample(s.t, s.message), clock=lambda: next(clock)
    )
    for _ in range(5):
        sampler.sample_once()
    assert source.calls["nvmlDeviceGetComputeRunningProcesses"] == 5 * 8
    assert source.calls["nvmlDeviceGetMemoryInfo"] == 5 * 8
    assert source.calls["nvmlDeviceGetUtilizationRates"] == 5 * 8
    assert {len(box) for box in received} == {5}


async def test_sampler_thread_hands_samples_to_the_loop_and_reads_once_per_sample() -> None:
    source = SimulatedSource(share(), device_count=4, latencies=FREE)
    loop = asyncio.get_running_loop()
    seen_on: set[int] = set()
    fanout = Fanout()
    counts = [0] * 30

    def deliver(i: int) -> None:
        counts[i] += 1

    for i in range(30):
        fanout.add(Subscriber(lambda _m, i=i: deliver(i), rate_hz=100, period_seconds=0.25))

    def on_sample(s: object) -> None:
        seen_on.add(threading.get_ident())
        fanout.publish_sample(s.t, s.message)  # type: ignore[attr-defined]

    sampler = Sampler(source, 0.25, 60, on_sample)
    sampler.start(loop)
    try:
        deadline = time.monotonic() + 30
        while sampler.samples_taken < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        sampler.stop()
    await asyncio.sleep(0)  # let the last handed-over sample run
    taken = sampler.samples_taken
    assert taken >= 4
    assert seen_on == {threading.get_ident()}, "samples are delivered on the loop's thread"
    assert source.calls["nvmlDeviceGetComputeRunningProcesses"] == taken * 4
    assert set(counts) == {taken}
    assert sampler.cpu_seconds > 0


def test_a_client_asking_twenty_hertz_gets_at_most_one_push_per_sample() -> None:
    assert clamp_rate(20, 1.0) == 1.0
    assert clamp_rate(20, 0.25) == 4.0
    assert clamp_rate(0.2, 1.0) == 0.2
    for nonsense in (None, 0, -3, float("nan"), float("inf")):
        assert clamp_rate(nonsense, 1.0) == 1.0
    assert clamp_rate(1e-9, 1.0) == 0.01


def test_a_slow_client_gets_every_fifth_sample_despite_jitter() -> None:
    got: list[str] = []
    sub = Subscriber(got.append, rate_hz=0.2, period_seconds=1.0)
    jitter = [0.0, 0.03, -0.02, 0.04, -0.04]
    for i in range(20):
        sub.offer(1000.0 + i + jitter[i % 5], f"m{i}")
    assert got == ["m0", "m5", "m10", "m15"]


def test_history_is_a_bounded_ring_and_since_filters_it() -> None:
    source = SimulatedSource(share(), device_count=1, latencies=FREE)
    clock = iter(float(t) for t in range(100, 200))
    sampler = Sampler(source, 1.0, history_seconds=5, clock=lambda: next(clock))
    for _ in range(12):
        sampler.sample_once()
    history = sampler.history()
    assert sampler.capacity == 5
    assert [s.t for s in history] == [107.0, 108.0, 109.0, 110.0, 111.0]
    assert [s.t for s in sampler.history(since=109.0)] == [110.0, 111.0]
    assert sampler.latest() is history[-1]


def test_a_failing_source_does_not_stop_sampling() -> None:
    source = SimulatedSource(share(), device_count=1, latencies=FREE)
    sampler = Sampler(source, 1.0, 60)
    real = source.sample
    source.sample = lambda: (_ for _ in ()).throw(RuntimeError("GPU is lost"))  # type: ignore[method-assign]
    assert sampler.sample_once() is None
    source.sample = real  # type: ignore[method-assign]
    assert sampler.sample_once() is not None
    assert sampler.errors == 1 and sampler.samples_taken == 1


def test_simulated_latencies_are_spent_and_counted_per_call() -> None:
    lat = Latencies(utilization=50e-6, memory=120e-6, processes=5e-3)
    source = SimulatedSource(share(), device_count=3, latencies=lat)
    t0 = time.perf_counter()
    source.sample()
    elapsed = time.perf_counter() - t0
    # a wait never ends early (lower bound only: a loaded machine may take longer)
    assert elapsed >= 3 * (50e-6 + 120e-6 + 5e-3)
    assert source.calls == {
        "nvmlDeviceGetUtilizationRates": 3,
        "nvmlDeviceGetMemoryInfo": 3,
        "nvmlDeviceGetComputeRunningProcesses": 3,
        "nvmlDeviceGetTemperature": 3,
        "nvmlDeviceGetPowerUsage": 3,
    }


def test_a_microsecond_wait_spins_for_at_least_its_duration() -> None:
    t0 = time.perf_counter()
    spend(30e-6)
    assert time.perf_counter() - t0 >= 30e-6


def test_the_process_list_wait_sleeps_and_costs_the_thread_no_cpu() -> None:
    """The 4.5 ms process list is modelled as a driver wait that releases the GIL, not a spin."""
    source = SimulatedSource(share(), device_count=2, latencies=Latencies(processes=0.15))
    result: dict[str, float] = {}

    def run() -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        source.sample()
        result["cpu"], result["wall"] = time.thread_time() - cpu0, time.perf_counter() - wall0

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert result["wall"] >= 0.3
    assert result["cpu"] < 0.1 * result["wall"]


@settings(max_examples=200, deadline=None)
@given(
    period=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
    requested=st.floats(min_value=0.001, max_value=1000, allow_nan=False),
    jitter=st.lists(st.floats(min_value=-0.2, max_value=0.2), min_size=200, max_size=200),
)
def test_pushes_keep_to_the_clamped_rate_and_never_starve(
    period: float, requested: float, jitter: list[float]
) -> None:
    """Whatever a client asks and however samples jitter (< 1/4 period), its pushes come once per
    1/rate, give or take one sample: never faster than the sampler, never a gap of two intervals."""
    pushed: list[float] = []
    sub = Subscriber(lambda m: None, requested, period)
    for i, j in enumerate(jitter):
        t = 1000.0 + i * period + j * period
        if sub.offer(t, ""):
            pushed.append(t)
    assert sub.rate_hz <= 1 / period
    gaps = [b - a for a, b in zip(pushed, pushed[1:], strict=False)]
    assert all(g > period / 2 for g in gaps), "at most one push per sample"
    assert all(g <= sub.interval + 1.5 * period for g in gaps), "no starvation"
    span = len(jitter) * period
    if sub.interval < span / 4:
        assert len(pushed) >= span / (sub.interval + 1.5 * period) - 1


async def test_fifty_panels_are_served_in_chunks_with_alerts_after_their_sample() -> None:
    fanout = Fanout()
    boxes: list[list[str]] = [[] for _ in range(50)]
    for box in boxes:
        fanout.add(Subscriber(box.append, rate_hz=1, period_seconds=1.0))
    fanout.publish_sample(100.0, "sample", ["alert"])
    assert sum(1 for box in boxes if box) == CHUNK, "the first chunk at once, the rest later"
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(box == ["sample", "alert"] for box in boxes)
