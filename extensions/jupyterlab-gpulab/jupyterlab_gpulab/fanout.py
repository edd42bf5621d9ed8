"""Websocket subscribers: clamp each client's rate to the sampler's, decimate for slower ones."""

from __future__ import annotations

import math
from collections.abc import Callable

MIN_RATE_HZ = 0.01


def clamp_rate(requested_hz: float | None, period_seconds: float) -> float:
    """The rate a client gets: at most one push per sample, however fast it asks."""
    fastest = 1.0 / period_seconds
    if requested_hz is None or not math.isfinite(requested_hz) or requested_hz <= 0:
        return fastest
    return max(MIN_RATE_HZ, min(requested_hz, fastest))


class Subscriber:
    """One panel: gets every k-th sample so that its pushes come at its (clamped) rate."""

    def __init__(
        self, send: Callable[[str], object], rate_hz: float, period_seconds: float
    ) -> None:
        self.send = send
        self.rate_hz = clamp_rate(rate_hz, period_seconds)
        self.interval = 1.0 / self.rate_hz
        # half a period of slack: samples land on the period grid, give or take jitter
        self._slack = period_seconds / 2
        self._last_t: float | None = None
        self.pushed = 0

    def offer(self, t: float, message: str) -> bool:
        if self._last_t is not None and t - self._last_t < self.interval - self._slack:
            return False
        self._last_t = t
        self.pushed += 1
        self.send(message)
        return True


class Fanout:
    """All connected panels of this server. Loop-side only (no locking)."""

    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()

    def __len__(self) -> int:
        return len(self.subscribers)

    def add(self, sub: Subscriber) -> None:
        self.subscribers.add(sub)

    def discard(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def publish_sample(self, t: float, message: str) -> None:
        for sub in list(self.subscribers):
            sub.offer(t, message)

    def broadcast(self, message: str) -> None:
        """Alerts go to every panel at once, whatever its rate."""
        for sub in list(self.subscribers):
            sub.send(message)
