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


def task_key(r: Request) -> tuple[int, int, int, frozenset[str]]:
    """(cpu, GPUs needed, milli per GPU, models): FGD's pod resource key (memory is ignored)."""
    if r.gpu_milli:
        return (r.cpu_milli, 1, r.gpu_milli, r.gpu_models)
    if r.num_gpu:
        return (r.cpu_milli, r.num_gpu, MILLI, r.gpu_models)
    return (r.cpu_milli, 0, 0, frozenset())


def typical_tasks(requests: Iterable[Request], popularity: float = 0.95) -> tuple[TaskType, ...]:
    """The most common task kinds covering ``popularity`` of ``requests``, weights renormalised.

    As the FGD paper: kinds sorted by count (descending), added one at a time until their
    cumulative share reaches ``popularity``; CPU-only tasks are included.
    """
    counts: Counter[tuple[int, int, int, frozenset[str]]] = Counter()
    for r in requests:
        counts[task_key(r)] += 1
    total = sum(counts.values())
    if not total:
        return ()
    ranked = sorted(
        counts.items(),
        key=lambda kv: (kv[1], kv[0][0], kv[0][2], kv[0][1], sorted(kv[0][3])),
        reverse=True,
    )
    chosen: list[tuple[tuple[int, int, int, frozenset[str]], int]] = []
    cum = 0
    for key, n in ranked:
        if cum >= popularity * total:
            break
        chosen.append((key, n))
        cum += n
    return tuple(
        TaskType(cpu, 0, num, milli, models, n / cum) for (cpu, num, milli, models), n in chosen
    )
