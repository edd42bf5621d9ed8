"""Random-fit: a uniformly random node among those that fit (the paper's "Random" baseline)."""

from __future__ import annotations

from collections.abc import Collection

from ..state import ClusterState, Shape
from .base import Choice, Policy


class RandomFit(Policy):
    """Uniform over feasible nodes, then uniform over the distinct GPU choices on the node."""

    name = "random"

    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        feasible: list[tuple[list[tuple[int, ...]], list[int]]] = []
        total = 0
        pool = state.groups.items() if nodes is None else ((state.sig[i], {i}) for i in nodes)
        for sig, group in pool:
            options = state.options(sig, shape)
            if options:
                members = sorted(group)
                feasible.append((options, members))
                total += len(members)
        if not feasible:
            return None
        k = self.rng.randrange(total)
        for options, members in feasible:
            if k < len(members):
                return members[k], options[self.rng.randrange(len(options))]
            k -= len(members)
        raise AssertionError("unreachable")
