"""One sampler thread per server: every device once per period, a bounded history, a loop handoff.

The thread, not the event loop, waits for NVML; each sample is serialised in the thread too, so
the loop only forwards ready-made strings to its websockets.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .sources import DeviceSample, Source

log = logging.getLogger(__name__)

MIN_PERIOD_SECONDS = 0.25


@dataclass(frozen=True)
class Sample:
    t: float  # unix seconds
    devices: dict[str, DeviceSample]
    json: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    text: str = field(repr=False, compare=False, default="")  # `json`, encoded
    message: str = field(repr=False, compare=False, default="")  # the websocket push, encoded

    @classmethod
    def build(cls, t: float, devices: dict[str, DeviceSample]) -> Sample:
        body = {"t": t, "devices": {uuid: d.to_json() for uuid, d in devices.items()}}
        text = json.dumps(body)
        return cls(t, devices, body, text, '{"type": "sample", "sample": ' + text + "}")


def samples_json(samples: list[Sample]) -> str:
    """{"samples": [...]} from the texts encoded in the sampler thread: no encoding on the loop."""
    return '{"samples": [' + ", ".join(s.text for s in samples) + "]}"


class Sampler:
    """Samples `source` every `period_seconds` in a daemon thread, however many clients listen."""

    def __init__(
        self,
        source: Source,
        period_seconds: float = 1.0,
        history_seconds: float = 1800.0,
        on_sample: Callable[[Sample], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if period_seconds < MIN_PERIOD_SECONDS:
            raise ValueError(
                f"period_seconds={period_seconds} is below the minimum {MIN_PERIOD_SECONDS}"
            )
        self.source = source
        self.period_seconds = period_seconds
        self.history_seconds = history_seconds
        self.on_sample = on_sample
        self.clock = clock
        self._history: deque[Sample] = deque(maxlen=max(1, round(history_seconds / period_seconds)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.samples_taken = 0
        self.errors = 0
        self.cpu_seconds = 0.0  # the sampler thread's own CPU time (time.thread_time)
        self._started_monotonic: float | None = None
        self._last_error = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the thread; samples are handed to `on_sample` on `loop` (or in the thread)."""
        if self._thread is not None:
            return
        self._loop = loop
        self._thread = threading.Thread(
            target=self._run, name="gpulab-monitor-sampler", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        self._started_monotonic = time.monotonic()
        deadline = self._started_monotonic
        while not self._stop.is_set():
            self.sample_once()
            self.cpu_seconds = time.thread_time()
            deadline += self.period_seconds
            delay = deadline - time.monotonic()
            if delay < 0:  # a slow source: skip the missed ticks rather than burst
                deadline = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def sample_once(self) -> Sample | None:
        """Read every device once, keep it, hand it over. Runs in the sampler thread."""
        try:
            devices = self.source.sample()
        except Exception as e:  # a driver hiccup must not end monitoring
            self.errors += 1
            if str(e) != self._last_error:
                self._last_error = str(e)
                log.warning("gpulab monitor: sampling %s devices failed: %s", self.source.kind, e)
            return None
        sample = Sample.build(self.clock(), devices)
        with self._lock:
            self._history.append(sample)
            self.samples_taken += 1
        self._hand_over(sample)
        return sample

    def _hand_over(self, sample: Sample) -> None:
        if self.on_sample is None:
            return
        if self._loop is None:
            self.on_sample(sample)
            return
        try:
            self._loop.call_soon_threadsafe(self.on_sample, sample)
        except RuntimeError:  # the loop closed: the server is shutting down
            self._stop.set()

    # -- readers (any thread) ------------------------------------------------------------------

    @property
    def wall_seconds(self) -> float:
        return (
            0.0 if self._started_monotonic is None else time.monotonic() - self._started_monotonic
        )

    def latest(self) -> Sample | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self, since: float = 0.0) -> list[Sample]:
        """Samples newer than `since` (unix seconds), oldest first."""
        with self._lock:
            samples = list(self._history)
        start = bisect.bisect_right([s.t for s in samples], since)
        return samples[start:]

    @property
    def capacity(self) -> int:
        return self._history.maxlen or 0
