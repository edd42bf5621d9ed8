"""FGD: fragmentation gradient descent (Weng et al., USENIX ATC 2023), as published.

Places a request where the node's expected fragmentation (see ``frag.FragModel``; memory is not
modelled, as in the paper) grows least, GPU by GPU for fractional requests. Like the paper's
simulator the gradient is bucketed as ``int(100 * sigmoid(-delta / 1000))`` and ties go to the
first node in inventory order; ``exact=True`` compares the raw gradients instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

from ..frag import FragModel
from ..model import Request
from ..state import ClusterState, Shape, Sig
from ..workload import TaskType, typical_tasks
from .base import ScoredPolicy


def bucket(delta: float, scale: float = 1000.0) -> int:
    """The paper's score bucket of a fragmentation change (higher is better)."""
    x = -delta / scale
    if x < -700:
        return 0
    return int(100.0 / (1.0 + math.exp(-x)))


class FGD(ScoredPolicy):
    """Minimises the increase of expected fragmentation for a target workload.

    ``workload``: the expected task mix (``workload.typical_tasks``); when None the policy
    learns it from the requests it places, re-estimated each time their count doubles.
    """

    name = "fgd"
    with_memory = False
    #: ``typical_tasks``' cut by GPU demand beside the paper's by count (None: the paper's only)
    demand_popularity: ClassVar[float | None] = None

    def __init__(
        self,
        seed: int | None = None,
        workload: Iterable[TaskType] | None = None,
        random_ties: bool = False,
        exact: bool = False,
    ) -> None:
        super().__init__(seed, random_ties)
        self.exact = exact
        self._learn = workload is None
        self._seen: list[Request] = []
        self._next_refit = 16
        self.set_workload(workload or ())

    @classmethod
    def mix_of(cls, requests: Iterable[Request]) -> tuple[TaskType, ...]:
        """The task mix this policy targets for ``requests`` (what it learns from them)."""
        return typical_tasks(
            requests, with_memory=cls.with_memory, demand_popularity=cls.demand_popularity
        )

    def set_workload(self, workload: Iterable[TaskType]) -> None:
        """Replace the target workload (drops cached scores)."""
        self.model = FragModel(workload, with_memory=self.with_memory)
        self.invalidate()

    def observe(self, request: Request) -> None:
        if not self._learn:
            return
        self._seen.append(request)
        if len(self._seen) >= self._next_refit:
            self._next_refit *= 2
            self.set_workload(self.mix_of(self._seen))

    def delta(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        """Change of the node's expected fragmentation if ``shape`` goes there via ``option``."""
        cid, cpu_free, mem_free, gpus = sig
        cls = state.classes[cid]
        after = state.after(sig, shape, option)
        before = self.model.frag(cid, cls, cpu_free, mem_free, gpus)
        return self.model.frag(cid, cls, after[1], after[2], after[3]) - before

    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        d = self.delta(state, sig, shape, option)
        return d if self.exact else -float(bucket(d))
