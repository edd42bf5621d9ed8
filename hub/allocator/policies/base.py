"""The policy interface and a cached, score-based base class."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import ClassVar

from ..model import Request
from ..state import ClusterState, Shape, Sig

#: ``(node index, GPU positions in the node's canonical order)``
Choice = tuple[int, tuple[int, ...]]
#: a cached evaluation: ``(score, option)``, or None when the shape does not fit
Scored = tuple[float, tuple[int, ...]] | None


class Policy(ABC):
    """Chooses a node (and GPUs on it) for a request shape; never mutates the state."""

    name: ClassVar[str]

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    @abstractmethod
    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        """Best placement of ``shape``, restricted to ``nodes`` when given; None if none fits."""

    def observe(self, request: Request) -> None:  # noqa: B027
        """Hook called after every placement (policies that learn the workload mix use it)."""


class ScoredPolicy(Policy):
    """A policy that scores each (signature, option); lower is better.

    Ties go to the first node in inventory order (as in the FGD paper's simulator, which picks
    the lexicographically smallest node name), or to a random one with ``random_ties``.
    Scores depend only on the signature, so they are cached per (shape, signature id).
    """

    cache_limit: ClassVar[int] = 2_000_000

    def __init__(self, seed: int | None = None, random_ties: bool = False) -> None:
        super().__init__(seed)
        #: break ties at random (True) or by inventory order (False, the FGD simulator's rule)
        self.random_ties = random_ties
        self._cache: dict[Shape, dict[int, Scored]] = {}
        self._cached = 0
        self._generation = 0

    @abstractmethod
    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        """Cost of placing ``shape`` on a node in state ``sig`` via ``option`` (lower wins)."""

    def evaluate(self, state: ClusterState, sig: Sig, shape: Shape) -> Scored:
        """The cheapest option of ``shape`` on ``sig`` with its score (uncached)."""
        result: Scored = None
        for option in state.options(sig, shape):
            s = self.score(state, sig, shape, option)
            if result is None or s < result[0]:
                result = (s, option)
        return result

    def shape_cache(self, state: ClusterState, shape: Shape) -> dict[int, Scored]:
        """The per-signature-id cache of one shape (reset when the state renumbers ids)."""
        if state.generation != self._generation or self._cached >= self.cache_limit:
            self.invalidate()
            self._generation = state.generation
        per = self._cache.get(shape)
        if per is None:
            per = self._cache[shape] = {}
        return per

    def best(self, state: ClusterState, sid: int, shape: Shape) -> Scored:
        """Cached ``evaluate`` for signature id ``sid``."""
        per = self.shape_cache(state, shape)
        if sid in per:
            return per[sid]
        r = per[sid] = self.evaluate(state, state.sigs[sid], shape)
        self._cached += 1
        return r

    def invalidate(self) -> None:
        """Drop cached scores (call when the score function's inputs change)."""
        self._cache.clear()
        self._cached = 0

    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        if nodes is not None:
            return self._choose_among(state, shape, nodes)
        per = self.shape_cache(state, shape)
        best_score = float("inf")
        winners: list[tuple[int, tuple[int, ...]]] = []
        sigs = state.sigs
        for sid in state.candidates(shape):
            if sid in per:
                r = per[sid]
            else:
                r = per[sid] = self.evaluate(state, sigs[sid], shape)
                self._cached += 1
            if r is None:
                continue
            if r[0] < best_score:
                best_score = r[0]
                winners = [(sid, r[1])]
            elif r[0] == best_score:
                winners.append((sid, r[1]))
        return self._pick(state, winners)

    def _pick(
        self, state: ClusterState, winners: list[tuple[int, tuple[int, ...]]]
    ) -> Choice | None:
        if not winners:
            return None
        groups = state.groups
        if not self.random_ties:
            if len(winners) == 1:
                sid, option = winners[0]
                return min(groups[sid]), option
            return min((min(groups[sid]), option) for sid, option in winners)
        total = sum(len(groups[sid]) for sid, _ in winners)
        k = self.rng.randrange(total) if total > 1 else 0
        for sid, option in winners:
            n = len(groups[sid])
            if k < n:
                return sorted(groups[sid])[k], option
            k -= n
        raise AssertionError("unreachable")

    def _choose_among(
        self, state: ClusterState, shape: Shape, nodes: Collection[int]
    ) -> Choice | None:
        best_score = float("inf")
        cands: list[tuple[int, tuple[int, ...]]] = []
        for i in nodes:
            r = self.best(state, state.node_sid[i], shape)
            if r is None:
                continue
            if r[0] < best_score:
                best_score = r[0]
                cands = [(i, r[1])]
            elif r[0] == best_score:
                cands.append((i, r[1]))
        if not cands:
            return None
        if not self.random_ties:
            return min(cands)
        return cands[self.rng.randrange(len(cands))] if len(cands) > 1 else cands[0]
