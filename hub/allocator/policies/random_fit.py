"""Random-fit: a uniformly random node among those that fit (the paper's "Random" baseline)."""

from __future__ import annotations

from collections.abc import Collection

from ..state import ClusterState, Shape
from .base import Choice, Policy


class RandomFit(Policy):
    """Uniform over feasible nodes, then uniform over the distinct GPU choices on the node."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._cache: dict[Shape, dict[int, list[tuple[int, ...]]]] = {}
        self._generation = 0
        self._cached = 0

    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        feasible: list[tuple[list[tuple[int, ...]], set[int]]] = []
        total = 0
        if state.generation != self._generation or self._cached > 1_000_000:
            self._cache.clear()
            self._cached = 0
            self._generation = state.generation
        per = self._cache.get(shape)
        if per is None:
            per = self._cache[shape] = {}
        sigs = state.sigs
        groups = state.groups
        pool = (
            ((sid, groups[sid]) for sid in state.candidates(shape))
            if nodes is None
            else ((state.node_sid[i], {i}) for i in nodes)
        )
        for sid, group in pool:
            options = per.get(sid)
            if options is None:
                options = per[sid] = state.options(sigs[sid], shape)
                self._cached += 1
            if options:
                feasible.append((options, group))
                total += len(group)
        if not feasible:
            return None
        k = self.rng.randrange(total)
        for options, group in feasible:
            if k < len(group):
                node = sorted(group)[k] if len(group) > 1 else next(iter(group))
                if shape[3]:  # a fraction: uniform over the GPUs it fits on, like the paper
                    positions = state.fitting_positions(state.sig(node), shape)
                    return node, (positions[self.rng.randrange(len(positions))],)
                return node, options[self.rng.randrange(len(options))]
            k -= len(group)
        raise AssertionError("unreachable")
