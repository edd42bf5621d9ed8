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

#: (weight of tasks never fitting, ((milli, num, max cpu rank, max mem rank, weight, rows), ...))
_Compiled = tuple[
    float, tuple[tuple[int, int, int, int, float, tuple[tuple[int, int, float], ...]], ...]
]


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
        # int keys and float values only: invisible to the cyclic garbage collector
        self._cache: dict[int, float] = {}
        self._gpus_ids: dict[tuple[int, ...], int] = {}
        self._compiled: dict[int, _Compiled] = {}
        self.total_weight = sum(t.weight for t in self.tasks)

    def levels(self, cpu_free: int, mem_free: int) -> tuple[int, int]:
        """How many distinct CPU / memory demands of the workload the free amounts cover."""
        mem = bisect_right(self.mem_levels, mem_free) if self.with_memory else 1
        return bisect_right(self.cpu_levels, cpu_free), mem

    def _compile(self, cls: NodeClass) -> _Compiled:
        """Per node class: weight of tasks that can never use its GPUs, and the others grouped."""
        model = cls.models[0] if cls.models else None
        never = 0.0
        demands: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
        for crank, mrank, num, milli, allowed, weight in self._rows:
            if (
                not num
                or model is None
                or num > len(cls.models)
                or (allowed and model not in allowed)
            ):
                never += weight
            else:
                demands.setdefault((milli, num), []).append((crank, mrank, weight))
        compiled = []
        for (milli, num), rows in sorted(demands.items()):
            rows.sort()
            compiled.append(
                (
                    milli,
                    num,
                    max(r[0] for r in rows),
                    max(r[1] for r in rows),
                    sum(r[2] for r in rows),
                    tuple(rows),
                )
            )
        return never, tuple(compiled)

    def frag(
        self, cid: int, cls: NodeClass, cpu_free: int, mem_free: int, gpus: tuple[int, ...]
    ) -> float:
        """Expected fragmentation (milli-GPU) of a node of class ``cls`` in the given state."""
        cl, ml = self.levels(cpu_free, mem_free)
        gid = self._gpus_ids.get(gpus)
        if gid is None:
            gid = self._gpus_ids[gpus] = len(self._gpus_ids)
        key = ((gid * 4096 + cid) * 4096 + cl) * 4096 + ml
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        total = sum(gpus)
        if not total:
            value = 0.0
        elif cls.interchangeable:
            value = self._frag_sorted(cid, cls, cl, ml, gpus, total)
        else:
            value = self._frag_general(cls, cl, ml, gpus, total)
        if len(self._cache) >= self.cache_limit:
            self._cache.clear()
            self._gpus_ids.clear()
        self._cache[key] = value
        return value

    def _frag_sorted(
        self, cid: int, cls: NodeClass, cl: int, ml: int, gpus: tuple[int, ...], total: int
    ) -> float:
        """Fast path: one GPU model, free shares sorted ascending."""
        compiled = self._compiled.get(cid)
        if compiled is None:
            compiled = self._compiled[cid] = self._compile(cls)
        n = len(gpus)
        value = self.total_weight * total  # start from "all of it is fragment for everyone"
        last_milli = -1
        usable = 0
        fits = 0
        for milli, num, cmax, mmax, wsum, rows in compiled[1]:
            if milli != last_milli:
                idx = bisect_left(gpus, milli)
                fits = n - idx
                usable = total - sum(gpus[:idx])
                last_milli = milli
            if fits < num:
                continue
            if cmax < cl and mmax < ml:
                w = wsum
            else:
                w = 0.0
                for crank, mrank, weight in rows:
                    if crank < cl and mrank < ml:
                        w += weight
            value -= w * usable
        return value

    def _frag_general(
        self, cls: NodeClass, cl: int, ml: int, gpus: tuple[int, ...], total: int
    ) -> float:
        """Any node: mixed models or NVLink groups, GPUs in index order."""
        value = 0.0
        per_share: dict[tuple[int, frozenset[str]], tuple[int, int]] = {}
        models = cls.models
        for crank, mrank, num, milli, allowed, weight in self._rows:
            if not num or crank >= cl or mrank >= ml:
                value += weight * total
                continue
            got = per_share.get((milli, allowed))
            if got is None:
                fits = small = 0
                for p, left in enumerate(gpus):
                    if left >= milli and (not allowed or models[p] in allowed):
                        fits += 1
                    else:
                        small += left
                got = per_share[(milli, allowed)] = (fits, small)
            value += weight * (got[1] if got[0] >= num else total)
        return value
