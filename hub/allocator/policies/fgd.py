"""FGD: fragmentation gradient descent (Weng et al., USENIX ATC 2023), exact.

A node's *fragmentation* for a target workload is the GPU capacity the workload's tasks are
expected not to be able to use there: for each task kind t (weight p_t), the free GPU milli
on GPUs too small for t when t fits the node otherwise, and all free GPU milli when t cannot
run there at all (too few GPUs, wrong model, not enough CPU, or a CPU-only task). FGD places a
request where the expected fragmentation grows least, GPU by GPU for fractional requests.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..model import Request
from ..state import ClusterState, Shape, Sig
from ..workload import TaskType, typical_tasks
from .base import ScoredPolicy


class FGD(ScoredPolicy):
    """Minimises the increase of expected fragmentation.

    ``workload``: the expected task mix; when None the policy learns it from the requests it
    places (re-estimated as their count doubles).
    """

    name = "fgd"
    frag_cache_limit = 400_000

    def __init__(
        self,
        seed: int | None = None,
        workload: Iterable[TaskType] | None = None,
        random_ties: bool = False,
    ) -> None:
        super().__init__(seed, random_ties)
        self._frag: dict[tuple[int, int, tuple[int, ...]], float] = {}
        self._learn = workload is None
        self._seen: list[Request] = []
        self._next_refit = 16
        self.set_workload(workload or ())

    def set_workload(self, workload: Iterable[TaskType]) -> None:
        """Replace the target workload (drops cached scores)."""
        self.tasks = tuple(workload)
        self._frag.clear()
        self.invalidate()

    def observe(self, request: Request) -> None:
        """Record a placed request (only when the workload is learnt online)."""
        if not self._learn:
            return
        self._seen.append(request)
        if len(self._seen) >= self._next_refit:
            self._next_refit *= 2
            self.set_workload(typical_tasks(self._seen))

    def frag(self, state: ClusterState, cid: int, cpu_free: int, gpus: tuple[int, ...]) -> float:
        """Expected fragmentation (milli-GPU) of a node of class ``cid`` in the given state."""
        key = (cid, cpu_free, gpus)
        hit = self._frag.get(key)
        if hit is not None:
            return hit
        cls = state.classes[cid]
        total = sum(gpus)
        value = 0.0
        if total:
            for t in self.tasks:
                if not t.num_gpu or cpu_free < t.cpu_milli:
                    value += t.weight * total
                    continue
                small = 0
                fits = 0
                for p, left in enumerate(gpus):
                    if left >= t.milli_per_gpu and (not t.models or cls.models[p] in t.models):
                        fits += 1
                    else:
                        small += left
                value += t.weight * (small if fits >= t.num_gpu else total)
        if len(self._frag) >= self.frag_cache_limit:
            self._frag.clear()
        self._frag[key] = value
        return value

    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        cid, cpu_free, _, gpus = sig
        after = state.after(sig, shape, option)
        before = self.frag(state, cid, cpu_free, gpus)
        return self.frag(state, cid, after[1], after[3]) - before
