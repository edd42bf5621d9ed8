"""Replay an arrival sequence through the allocator, recording allocation and latency."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpulab.hub.allocator import AllocationError, Allocator, Inventory, Policy
from gpulab.hub.allocator.openb import TracePod

from ._openb import Curve


@dataclass
class Run:
    curve: Curve
    #: per decision: CPU time of the calling thread (immune to other processes on the host)
    latencies_ns: list[int] = field(default_factory=list)
    #: per decision: wall-clock time
    wall_ns: list[int] = field(default_factory=list)
    placed: int = 0
    failed: int = 0
    #: refused pods by the whole GPUs they asked for (0: CPU only or a share of one GPU)
    refused_by_gpus: Counter[int] = field(default_factory=Counter)
    allocator: Allocator | None = None


def replay(
    inventory: Inventory,
    pods: Sequence[TracePod],
    policy: str | Policy | Callable[[], Policy],
    seed: int,
    stop_percent: float = 101.5,
) -> Run:
    """Place ``pods`` in order until arrived demand passes ``stop_percent`` of capacity."""
    pol = policy() if callable(policy) and not isinstance(policy, (str, Policy)) else policy
    alloc = Allocator(inventory, policy=pol, seed=seed)
    cap = inventory.total_gpu_milli
    run = Run(Curve(cap, [], []), allocator=alloc)
    arrived = 0
    limit = stop_percent * cap / 100
    clock = time.perf_counter_ns
    cpu = time.thread_time_ns
    for i, pod in enumerate(pods):
        if arrived > limit:
            break
        req = pod.to_request(f"p{i}")
        arrived += pod.total_gpu_milli
        t0 = clock()
        c0 = cpu()
        try:
            alloc.place(req)
            ok = True
        except AllocationError:
            ok = False
        c1 = cpu()
        run.wall_ns.append(clock() - t0)
        run.latencies_ns.append(c1 - c0)
        if ok:
            run.placed += 1
        else:
            run.failed += 1
            run.refused_by_gpus[req.num_gpu] += 1
        run.curve.arrived.append(arrived)
        run.curve.used.append(alloc.used_gpu_milli)
    return run
