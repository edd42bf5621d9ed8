"""Expected GPU fragmentation of a node for a target workload (the FGD paper's measure).

For each task kind t of the workload (weight p_t), the node's free GPU milli that t could not
use: when t fits the node (enough CPU, memory if modelled, enough GPUs of an allowed model with
at least t's share free) only the free milli on GPUs too small for t counts; otherwise all of
the node's free GPU milli does (CPU-only tasks cannot use GPUs at all). The expectation over
the workload is the node's fragmentation, in milli-GPU.

CPU and memory enter only through comparisons with the task kinds' demands, so values are
cached per (class, CPU level, memory level, free GPU shares).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

from .state import NodeClass
from .workload import TaskType


class FragModel:
    """Computes and caches node fragmentation for a fixed set of task kinds."""

    cache_limit = 1_000_000

    def __init__(self, tasks: Iterable[TaskType], with_memory: bool = True) -> None:
        self.tasks = tuple(tasks)
        self.with_memory = with_memory
        self.cpu_levels = sorted({t.cpu_milli for t in self.tasks})
        self.mem_levels = sorted({t.memory_mib for t in self.tasks}) if with_memory else [0]
        # (cpu rank, memory rank, GPUs needed, milli per GPU, models, weight)
        self._rows = [
            (
                bisect_left(self.cpu_levels, t.cpu_milli),
                bisect_left(self.mem_levels, t.memory_mib) if with_memory else 0,
                t.num_gpu,
                t.milli_per_gpu,
                t.models,
                t.weight,
            )
            for t in self.tasks
        ]
        self.cpu_only_weight = sum(t.weight for t in self.tasks if not t.num_gpu)
        self._cache: dict[tuple[int, int, int, tuple[int, ...]], float] = {}

    def levels(self, cpu_free: int, mem_free: int) -> tuple[int, int]:
        """How many distinct CPU / memory demands of the workload the free amounts cover."""
        mem = bisect_right(self.mem_levels, mem_free) if self.with_memory else 1
        return bisect_right(self.cpu_levels, cpu_free), mem

    def frag(
        self, cid: int, cls: NodeClass, cpu_free: int, mem_free: int, gpus: tuple[int, ...]
    ) -> float:
        """Expected fragmentation (milli-GPU) of a node of class ``cls`` in the given state."""
        cl, ml = self.levels(cpu_free, mem_free)
        key = (cid, cl, ml, gpus)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        total = sum(gpus)
        value = 0.0
        if total:
            per_share: dict[tuple[int, frozenset[str]], tuple[int, int]] = {}
            models = cls.models
            for crank, mrank, num, milli, allowed, weight in self._rows:
                if not num or crank >= cl or mrank >= ml:
                    value += weight * total
                    continue
                key2 = (milli, allowed)
                got = per_share.get(key2)
                if got is None:
                    fits = small = 0
                    for p, left in enumerate(gpus):
                        if left >= milli and (not allowed or models[p] in allowed):
                            fits += 1
                        else:
                            small += left
                    got = per_share[key2] = (fits, small)
                value += weight * (got[1] if got[0] >= num else total)
        if len(self._cache) >= self.cache_limit:
            self._cache.clear()
        self._cache[key] = value
        return value
