"""Choosing preemption victims: the cheapest set of preemptible placements that makes room.

Cost order: fewest victims, then fewest in-quota victims (over-quota spot work goes first), then
least lost work (youngest first). Only preemptible placements on one node are ever considered,
since a request always lands on a single node.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from math import comb

from .model import Placement
from .state import ClusterState, Shape

#: Above this many subsets of one size the search falls back to a greedy choice.
MAX_SUBSETS = 20_000


@dataclass(frozen=True)
class Victim:
    """A preemptible placement and the resources it holds on its node."""

    placement: Placement
    node: int
    cpu: int
    mem: int
    shares: tuple[tuple[int, int], ...]


Cost = tuple[int, int, float]


def victim_cost(victims: tuple[Victim, ...], now: float) -> Cost:
    """``(count, in-quota count, total age in seconds)``: lower is cheaper."""
    in_quota = sum(1 for v in victims if not v.placement.over_quota)
    age = sum(max(0.0, now - v.placement.created_at) for v in victims)
    return (len(victims), in_quota, age)


def fits_without(state: ClusterState, node: int, shape: Shape, victims: tuple[Victim, ...]) -> bool:
    """Whether ``shape`` fits on ``node`` once ``victims`` are released."""
    cpu = state.cpu_free[node] + sum(v.cpu for v in victims)
    mem = state.mem_free[node] + sum(v.mem for v in victims)
    free = list(state.gpu_free[node])
    for v in victims:
        for j, m in v.shares:
            free[j] += m
    sig, _ = state.signature_of(node, cpu, mem, free)
    return bool(state.options(sig, shape))


def cheapest_on_node(
    state: ClusterState, node: int, shape: Shape, candidates: list[Victim], now: float
) -> tuple[Cost, tuple[Victim, ...]] | None:
    """Cheapest victim set on one node, or None when even all of them are not enough."""
    if not candidates or not fits_without(state, node, shape, tuple(candidates)):
        return None
    for k in range(1, len(candidates) + 1):
        if comb(len(candidates), k) > MAX_SUBSETS:
            return _greedy(state, node, shape, candidates, now)
        best: tuple[Cost, tuple[Victim, ...]] | None = None
        for subset in combinations(candidates, k):
            if fits_without(state, node, shape, subset):
                cost = victim_cost(subset, now)
                if best is None or cost < best[0]:
                    best = (cost, subset)
        if best is not None:
            return best
    return None  # pragma: no cover - all candidates together fit, so some k succeeds


def _greedy(
    state: ClusterState, node: int, shape: Shape, candidates: list[Victim], now: float
) -> tuple[Cost, tuple[Victim, ...]]:
    """Add victims cheapest-first until the shape fits, then drop any that are not needed."""
    order = sorted(candidates, key=lambda v: victim_cost((v,), now))
    chosen: list[Victim] = []
    for v in order:
        chosen.append(v)
        if fits_without(state, node, shape, tuple(chosen)):
            break
    for v in sorted(chosen, key=lambda v: victim_cost((v,), now), reverse=True):
        rest = tuple(c for c in chosen if c is not v)
        if rest and fits_without(state, node, shape, rest):
            chosen = list(rest)
    subset = tuple(chosen)
    return victim_cost(subset, now), subset
