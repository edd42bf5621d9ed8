"""Websocket subscribers: clamp each client's rate to the sampler's, decimate for slower ones."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

MIN_RATE_HZ = 0.01
# panels served per loop callback: a push costs ~30 us per panel, so 50 panels in one callback
# would hold the loop ~1.5 ms; in chunks of 10 other callbacks run in between
CHUNK = 10


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

    def publish_sample(self, t: float, message: str, alerts: Sequence[str] = ()) -> None:
        """Offer a sample to every panel, then its alert transitions, in loop-friendly chunks."""
        targets = list(self.subscribers)

        def deliver(sub: Subscriber) -> None:
            if sub in self.subscribers:  # not closed since the sample came
                sub.offer(t, message)
                for alert in alerts:
                    sub.send(alert)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # off a loop (tests, no server): in one go
            for sub in targets:
                deliver(sub)
            return

        def serve(start: int) -> None:
            for sub in targets[start : start + CHUNK]:
                deliver(sub)
            if start + CHUNK < len(targets):
                loop.call_soon(serve, start + CHUNK)

        serve(0)

    def broadcast(self, message: str) -> None:
        """Alerts go to every panel at once, whatever its rate."""
        for sub in list(self.subscribers):
            sub.send(message)
