"""What a round of decisions amounts to: "would cull 3 servers, reclaim 36 GPU-h/day".

The same summary serves a dry run (what the policy would do if it were live) and a live round
(what it did); it reads only the decisions, so it reports exactly what decide() concluded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..profiles import MILLI_PER_GPU
from .policy import Decision

HOURS_PER_DAY = 24


@dataclass(frozen=True)
class RoundSummary:
    """``would_cull``: servers the policy culls now; ``reclaim_milli``: the GPU they hold, in
    milli-GPU; ``by_reason``: decisions per "verdict/cause" (e.g. "keep/ui-input": 4),
    counting each decision once under its first cause."""

    servers: int
    would_cull: int
    warned: int  # warn or wait: idle, warning running
    reclaim_milli: int
    by_reason: Mapping[str, int]
    dry_run: bool

    @property
    def reclaim_gpu_hours_per_day(self) -> float:
        """GPU-hours a day the culled servers' shares free, were they to stay idle all day."""
        return self.reclaim_milli * HOURS_PER_DAY / MILLI_PER_GPU

    def text(self) -> str:
        verb = "would cull" if self.dry_run else "culls"
        servers = "server" if self.would_cull == 1 else "servers"
        head = (
            f"{verb} {self.would_cull} {servers}, reclaim"
            f" {self.reclaim_gpu_hours_per_day:g} GPU-h/day"
        )
        reasons = ", ".join(f"{reason} {n}" for reason, n in self.by_reason.items())
        return f"{head} ({self.servers} checked; {reasons})" if reasons else head


def summarize_round(decisions: Iterable[Decision], dry_run: bool | None = None) -> RoundSummary:
    """Totals of one round of decisions (one per server). ``dry_run``: how to word it; by
    default, as the decisions were made (a dry run if any was)."""
    decided = list(decisions)
    culled = [d for d in decided if d.would_cull]
    counts = Counter(f"{d.verdict}/{d.causes[0]}" for d in decided)
    ordered = dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    return RoundSummary(
        servers=len(decided),
        would_cull=len(culled),
        warned=sum(d.verdict in ("warn", "wait") for d in decided),
        reclaim_milli=sum(d.held_milli for d in culled),
        by_reason=MappingProxyType(ordered),
        dry_run=any(d.dry_run for d in decided) if dry_run is None else dry_run,
    )
