"""The policy interface and a cached, score-based base class."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import ClassVar

from ..state import ClusterState, Shape, Sig

#: ``(node index, GPU positions in the node's canonical order)``
Choice = tuple[int, tuple[int, ...]]


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

    def observe(self, state: ClusterState, shape: Shape) -> None:  # noqa: B027
        """Hook called after every placement (policies that learn the workload mix use it)."""


class ScoredPolicy(Policy):
    """A policy that scores each (signature, option); lower is better, ties broken at random.

    Scores depend only on the signature, so they are cached per (signature, shape).
    """

    cache_limit: ClassVar[int] = 500_000

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._cache: dict[tuple[Sig, Shape], tuple[float, tuple[int, ...]] | None] = {}

    @abstractmethod
    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        """Cost of placing ``shape`` on a node in state ``sig`` via ``option`` (lower wins)."""

    def best(
        self, state: ClusterState, sig: Sig, shape: Shape
    ) -> tuple[float, tuple[int, ...]] | None:
        """The cheapest option of ``shape`` on ``sig`` with its score, cached."""
        key = (sig, shape)
        try:
            return self._cache[key]
        except KeyError:
            pass
        result: tuple[float, tuple[int, ...]] | None = None
        for option in state.options(sig, shape):
            s = self.score(state, sig, shape, option)
            if result is None or s < result[0]:
                result = (s, option)
        if len(self._cache) >= self.cache_limit:
            self._cache.clear()
        self._cache[key] = result
        return result

    def invalidate(self) -> None:
        """Drop cached scores (call when the score function's inputs change)."""
        self._cache.clear()

    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        best_score = float("inf")
        winners: list[tuple[Sig, tuple[int, ...], int]] = []
        if nodes is None:
            for sig, group in state.groups.items():
                r = self.best(state, sig, shape)
                if r is None:
                    continue
                if r[0] < best_score:
                    best_score = r[0]
                    winners = [(sig, r[1], len(group))]
                elif r[0] == best_score:
                    winners.append((sig, r[1], len(group)))
            if not winners:
                return None
            total = sum(w[2] for w in winners)
            k = self.rng.randrange(total) if total > 1 else 0
            for sig, option, n in winners:
                if k < n:
                    group = state.groups[sig]
                    node = next(iter(group)) if n == 1 else self.rng.choice(sorted(group))
                    return node, option
                k -= n
            raise AssertionError("unreachable")
        cands: list[tuple[int, tuple[int, ...]]] = []
        for i in nodes:
            r = self.best(state, state.sig[i], shape)
            if r is None:
                continue
            if r[0] < best_score:
                best_score = r[0]
                cands = [(i, r[1])]
            elif r[0] == best_score:
                cands.append((i, r[1]))
        if not cands:
            return None
        return cands[self.rng.randrange(len(cands))] if len(cands) > 1 else cands[0]
