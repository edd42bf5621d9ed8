"""GPU-seconds used, from the servers' pushes, for the GPU-hour ledger's "used" figures.

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
