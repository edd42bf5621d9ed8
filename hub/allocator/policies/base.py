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


class ShapeCache:
    """Scores of one shape per signature id, in two int/float-only dicts.

    Containers holding only ints and floats are not tracked by Python's cyclic garbage
    collector, so even millions of cached scores add nothing to collection pauses.
    """

    __slots__ = ("options", "scores")

    def __init__(self) -> None:
        self.scores: dict[int, float] = {}  # sid -> score, inf when the shape does not fit
        self.options: dict[int, int] = {}  # sid -> interned option id


INFEASIBLE = float("inf")


class ScoredPolicy(Policy):
    """A policy that scores each (signature, option); lower is better.

    Ties go to the first node in inventory order (as in the FGD paper's simulator, which picks
    the lexicographically smallest node name), or to a random one with ``random_ties``.
    Scores depend only on the signature, so they are cached per (shape, signature id).
    """

    cache_limit: ClassVar[int] = 4_000_000

    def __init__(self, seed: int | None = None, random_ties: bool = False) -> None:
        super().__init__(seed)
        #: break ties at random (True) or by inventory order (False, the FGD simulator's rule)
        self.random_ties = random_ties
        self._cache: dict[Shape, ShapeCache] = {}
        self._cached = 0
        self._generation = 0
        self._option_ids: dict[tuple[int, ...], int] = {}
        self._option_list: list[tuple[int, ...]] = []

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

    def shape_cache(self, state: ClusterState, shape: Shape) -> ShapeCache:
        """The per-signature-id cache of one shape (reset when the state renumbers ids)."""
        if state.generation != self._generation or self._cached >= self.cache_limit:
            self.invalidate()
            self._generation = state.generation
        per = self._cache.get(shape)
        if per is None:
            per = self._cache[shape] = ShapeCache()
        return per

    def fill(self, state: ClusterState, per: ShapeCache, sid: int, shape: Shape) -> float:
        """Evaluate ``sid`` for ``shape`` into ``per``; returns the score (inf: no fit)."""
        r = self.evaluate(state, state.sigs[sid], shape)
        self._cached += 1
        if r is None:
            per.scores[sid] = INFEASIBLE
            return INFEASIBLE
        option = r[1]
        oid = self._option_ids.get(option)
        if oid is None:
            oid = self._option_ids[option] = len(self._option_list)
            self._option_list.append(option)
        per.scores[sid] = r[0]
        per.options[sid] = oid
        return r[0]

    def best(self, state: ClusterState, sid: int, shape: Shape) -> Scored:
        """Cached ``evaluate`` for signature id ``sid``."""
        per = self.shape_cache(state, shape)
        s = per.scores.get(sid)
        if s is None:
            s = self.fill(state, per, sid, shape)
        if s == INFEASIBLE:
            return None
        return s, self._option_list[per.options[sid]]

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
        scores = per.scores
        best_score = INFEASIBLE
        winners: list[int] = []
        for sid in state.candidates(shape):
            s = scores.get(sid)
            if s is None:
                s = self.fill(state, per, sid, shape)
            if s < best_score:
                best_score = s
                winners = [sid]
            elif s == best_score and s != INFEASIBLE:
                winners.append(sid)
        return self._pick(state, per, winners)

    def _pick(self, state: ClusterState, per: ShapeCache, winners: list[int]) -> Choice | None:
        if not winners:
            return None
        groups = state.groups
        options = self._option_list
        if not self.random_ties:
            sid = winners[0] if len(winners) == 1 else min(winners, key=lambda w: min(groups[w]))
            return min(groups[sid]), options[per.options[sid]]
        total = sum(len(groups[sid]) for sid in winners)
        k = self.rng.randrange(total) if total > 1 else 0
        for sid in winners:
            n = len(groups[sid])
            if k < n:
                return sorted(groups[sid])[k], options[per.options[sid]]
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
