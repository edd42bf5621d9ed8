"""GPU-hour history written into a hub's ledger before the hub starts (days of use a test cannot
wait for): closed intervals and the monitor's used GPU-seconds, through the ledger's own store."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpulab.hub.ledger import Holding, UsageSample
from gpulab.hub.ledger.store import LedgerStore, sqlite_url

MODEL = "A100-SXM4-80GB"


@dataclass(frozen=True)
class Held:
    """`user` held `milli` of device `device` from `start` for `seconds` (whole seconds)."""

    user: str
    groups: tuple[str, ...]
    milli: int
    start: int
    seconds: int
    device: str = "GPU-seeded-0"
    profile: str = "gpu-1"
    workload: str = "server"  # "job": a job run's share (allocation "<user>/job-1"); "external"

    def holding(self) -> Holding:
        return Holding(
            allocation_id=f"{self.user}/" + ("job-1" if self.workload == "job" else ""),
            device=self.device,
            user=self.user,
            groups=tuple(sorted(self.groups)),
            workload=self.workload,
            profile=self.profile,
            gpu_model=MODEL,
            mig_profile=None,
            node="seeded-node",
            milli=self.milli,
            tier="on-demand",
        )


def seed_ledger(state_dir: Path, held: Iterable[Held], used: Iterable[UsageSample] = ()) -> None:
    """Write `held` as closed intervals (one after another: they must not overlap in time) and
    `used` as usage into the ledger a hub started in `state_dir` will open."""
    store = LedgerStore(sqlite_url(state_dir))
    try:
        for h in sorted(held, key=lambda h: h.start):
            store.sync([h.holding()], h.start)
            store.sync([], h.start + h.seconds)
        store.add_usage(list(used))
    finally:
        store.close()
