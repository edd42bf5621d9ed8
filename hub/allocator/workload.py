"""Target workload: the mix of request shapes a cluster expects (FGD's "typical pods")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .model import MILLI, Request


@dataclass(frozen=True)
class TaskType:
    """One kind of task of the expected mix, with its share of arrivals (0..1)."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int  # GPUs needed (1 for a fraction)
    milli_per_gpu: int  # 1..1000
    models: frozenset[str]
    weight: float

    @property
    def is_gpu(self) -> bool:
        return self.num_gpu > 0


TaskKey = tuple[int, int, int, int, frozenset[str]]


def task_key(r: Request, with_memory: bool = False) -> TaskKey:
    """(cpu, memory, GPUs needed, milli per GPU, models) of a request.

    The FGD paper's pod resource key leaves memory out (``with_memory=False`` gives 0 there).
    """
    mem = r.memory_mib if with_memory else 0
    if r.gpu_milli:
        return (r.cpu_milli, mem, 1, r.gpu_milli, r.gpu_models)
    if r.num_gpu:
        return (r.cpu_milli, mem, r.num_gpu, MILLI, r.gpu_models)
    return (r.cpu_milli, mem, 0, 0, frozenset())


def typical_tasks(
    requests: Iterable[Request],
    popularity: float = 0.95,
    with_memory: bool = False,
    demand_popularity: float | None = None,
) -> tuple[TaskType, ...]:
    """The most common task kinds covering ``popularity`` of ``requests``, weights renormalised.

    As the FGD paper: kinds sorted by count (descending), added one at a time until their
    cumulative share reaches ``popularity``; CPU-only tasks are included.

    ``demand_popularity`` (None: the paper's cut alone) also keeps the kinds carrying that share
    of the GPU demand, largest demand first. A kind few by count but large by size (8-GPU pods
    in many CPU and memory sizes, each a fraction of a percent of the pods) falls below the
    count cut although it asks for a good part of the GPUs; without it the mix would hold no
    reason to keep whole nodes free. Weights stay shares of arrivals among the kinds kept.
    """
    counts: Counter[TaskKey] = Counter()
    for r in requests:
        counts[task_key(r, with_memory)] += 1
    total = sum(counts.values())
    if not total:
        return ()
    ranked = sorted(
        counts.items(),
        key=lambda kv: (kv[1], kv[0][0], kv[0][3], kv[0][2], kv[0][1], sorted(kv[0][4])),
        reverse=True,
    )
    chosen: dict[TaskKey, int] = {}
    cum = 0
    for key, n in ranked:
        if cum >= popularity * total:
            break
        chosen[key] = n
        cum += n
    if demand_popularity is not None:
        demand = {key: n * key[2] * key[3] for key, n in ranked}
        gpu_total = sum(demand.values())
        covered = 0
        # a stable sort of the count ranking: equal demand keeps the order above
        for key, n in sorted(ranked, key=lambda kv: demand[kv[0]], reverse=True):
            if covered >= demand_popularity * gpu_total:
                break
            covered += demand[key]
            if key not in chosen:
                chosen[key] = n
                cum += n
    return tuple(
        TaskType(cpu, mem, num, milli, models, n / cum)
        for (cpu, mem, num, milli, models), n in chosen.items()
    )
