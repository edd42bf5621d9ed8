"""From the servers' pushes to the GPU-hour ledger's database: GPU-seconds used, and each slice's
latest figures with its GPU-idle time (the admin panel's live columns, the culler's slices).

Each push carries each GPU's utilisation (a fractional share's own processes' figure where NVML
gives one per process, else the device's). Between two pushes of the same server and GPU, the
GPU was used for utilisation x seconds; a gap longer than `max_gap_seconds` (a server that
stopped pushing) counts only up to it. The figures are summed per user, server, device and UTC
hour, and added to the ledger's database once per listing cycle; the hub caps them at what was
allocated when it rolls them up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulab.hub.alerts import Sample
from gpulab.hub.ledger import UsageSample
from gpulab.hub.ledger.store import LiveFigure


@dataclass
class UsageMeter:
    max_gap_seconds: float
    _last: dict[tuple[str, str, str], float] = field(default_factory=dict)
    _sums: dict[tuple[str, str, str, int], list[float]] = field(default_factory=dict)

    def observe(self, user: str, server: str, gpus: dict[str, Sample]) -> None:
        for device, sample in gpus.items():
            key = (user, server, device)
            previous = self._last.get(key)
            self._last[key] = sample.t
            if previous is None or sample.utilization_pct is None or sample.t <= previous:
                continue
            seconds = min(sample.t - previous, self.max_gap_seconds)
            used = min(max(sample.utilization_pct, 0.0), 100.0) / 100.0 * seconds
            hour = int(sample.t - seconds / 2) // 3600 * 3600
            sums = self._sums.setdefault((user, server, device, hour), [0.0, 0.0])
            sums[0] += used
            sums[1] += seconds

    def forget(self, user: str, server: str) -> None:
        """A server that stopped: its next start begins a new stretch."""
        for key in [k for k in self._last if k[:2] == (user, server)]:
            del self._last[key]

    def take(self) -> list[UsageSample]:
        """What was summed since the last take (and forget it)."""
        out = [
            UsageSample(user, server, device, hour, used, sampled)
            for (user, server, device, hour), (used, sampled) in self._sums.items()
        ]
        self._sums = {}
        return out

    def give_back(self, samples: list[UsageSample]) -> None:
        """Samples a failed write could not add: kept for the next one."""
        for s in samples:
            sums = self._sums.setdefault((s.user, s.server, s.device, s.hour), [0.0, 0.0])
            sums[0] += s.used_gpu_seconds
            sums[1] += s.sampled_seconds


@dataclass
class LiveSlices:
    """Each slice's latest figures and since when it has been idle (below `idle_pct` with no
    gap longer than `max_gap_seconds`), to be written to the ledger's live table."""

    idle_pct: float
    max_gap_seconds: float
    _figures: dict[tuple[str, str, str], LiveFigure] = field(default_factory=dict)
    _dirty: set[tuple[str, str, str]] = field(default_factory=set)
    _gone: set[tuple[str, str]] = field(default_factory=set)

    def observe(self, user: str, server: str, gpus: dict[str, Sample]) -> None:
        for device, sample in gpus.items():
            key = (user, server, device)
            previous = self._figures.get(key)
            below_since: float | None = None
            util = sample.utilization_pct
            if util is not None and util < self.idle_pct:
                below_since = sample.t
                if (
                    previous is not None
                    and previous.below_since is not None
                    and sample.t - previous.t <= self.max_gap_seconds
                ):
                    below_since = previous.below_since
            self._figures[key] = LiveFigure(
                user,
                server,
                device,
                sample.t,
                util,
                sample.memory_used_mib,
                sample.memory_limit_mib,
                below_since,
                self.idle_pct,
            )
            self._dirty.add(key)
        self._gone.discard((user, server))

    def forget(self, user: str, server: str) -> None:
        for key in [k for k in self._figures if k[:2] == (user, server)]:
            del self._figures[key]
            self._dirty.discard(key)
        self._gone.add((user, server))

    @property
    def pending(self) -> bool:
        return bool(self._dirty or self._gone)

    def take(self) -> tuple[list[LiveFigure], list[tuple[str, str]]]:
        """Figures changed and servers gone since the last take."""
        figures = [self._figures[k] for k in self._dirty if k in self._figures]
        gone = sorted(self._gone)
        self._dirty, self._gone = set(), set()
        return figures, gone

    def give_back(self, figures: list[LiveFigure], gone: list[tuple[str, str]]) -> None:
        for f in figures:
            if (f.user, f.server, f.device) in self._figures:
                self._dirty.add((f.user, f.server, f.device))
        self._gone.update(gone)
