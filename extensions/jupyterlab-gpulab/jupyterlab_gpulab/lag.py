"""Event-loop lag: how late a periodic callback runs; opt-in (GPUMonitor.measure_loop_lag)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class LoopLagMeter:
    """Schedules itself every `interval_seconds` and records how late each call ran."""

    def __init__(self, interval_seconds: float = 0.01, keep: int = 100_000) -> None:
        self.interval = interval_seconds
        self.lags: deque[float] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expected = 0.0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._expected = time.perf_counter() + self.interval
        self._handle = loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self.lags.append(max(0.0, now - self._expected))
        self._expected = now + self.interval
        assert self._loop is not None
        self._handle = self._loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def reset(self) -> None:
        with self._lock:
            self.lags.clear()

    def summary(self) -> dict[str, float]:
        with self._lock:
            lags = list(self.lags)
        return {
            "count": len(lags),
            "interval_ms": self.interval * 1000,
            "p50_ms": percentile(lags, 0.5) * 1000,
            "p95_ms": percentile(lags, 0.95) * 1000,
            "p99_ms": percentile(lags, 0.99) * 1000,
            "max_ms": max(lags, default=0.0) * 1000,
        }
