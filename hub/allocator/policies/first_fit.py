"""First-fit: the first node in inventory order that fits, lowest-index GPUs on it."""

from __future__ import annotations

from collections.abc import Collection

from ..state import ClusterState, Shape
from .base import Choice, Policy


class FirstFit(Policy):
    """Deterministic first-fit over the inventory order (the simplest packing baseline)."""

    name = "first-fit"

    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        best: Choice | None = None
        groups = state.groups
        pool = (
            ((sid, groups[sid]) for sid in state.candidates(shape))
            if nodes is None
            else ((state.node_sid[i], {i}) for i in nodes)
        )
        for sid, group in pool:
            options = state.options(state.sigs[sid], shape)
            if not options:
                continue
            node = min(group)
            if best is None or node < best[0]:
                order = state.order[node]
                # lowest physical GPU index among equivalent choices
                option = min(options, key=lambda o: sorted(order[p] for p in o))
                best = (node, option)
        return best
