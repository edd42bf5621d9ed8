"""The openb trace and the FGD paper's evaluation method ("workload tuning"), re-implemented.

Method, as in hkust-adsl/kubernetes-scheduler-simulator (read, not copied):
- the trace's pods are sorted by name and shuffled with the seed (``--shuffle-pod=true``);
- if their GPU request is below ``ratio`` x capacity, pods drawn uniformly *with replacement*
  from the whole trace (CPU-only pods included) are appended until the next one would pass the
  target; if above, random pods are removed until it is met;
- pods are placed one by one, no departures; after every pod (placed or not) the arrived GPU
  request and the allocated GPU milli are recorded;
- the value at arrived demand N % is the mean allocation ratio (% of all GPU milli, 2 decimals)
  over the records whose arrived demand rounds to N % (falling back to N±1 when none do).
"""

from __future__ import annotations

import csv
import os
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpulab.hub.allocator.openb import TracePod, load_openb_pods, open_trace_csv

WORKLOADS = ("default", "gpushare40", "multigpu50", "gpuspec33")
#: paper policy directory name -> short name
PAPER_POLICIES = {
    "01-Random": "random",
    "02-DotProd": "dotprod",
    "03-GpuClustering": "gpuclustering",
    "04-GpuPacking": "gpupacking",
    "05-BestFit": "best-fit",
    "06-FGD": "fgd",
}
SEEDS = tuple(range(42, 52))


#: the trace as the repository carries it: gzip-compressed csv files (see its README.md)
REPO_TRACE = Path(__file__).resolve().parent / "data" / "openb"


def openb_dir() -> Path:
    """The trace folder: $GPULAB_OPENB_DIR, else bench/data/openb in the repository."""
    env = os.environ.get("GPULAB_OPENB_DIR")
    return Path(env) if env else REPO_TRACE


def trace_file(name: str) -> Path:
    """`name` (a .csv file of the trace) in openb_dir(): the gzip copy where there is one, else the
    plain csv (a $GPULAB_OPENB_DIR holding the upstream files)."""
    plain = openb_dir() / name
    packed = plain.with_name(plain.name + ".gz")
    return packed if packed.exists() else plain


def node_csv() -> Path:
    return trace_file("openb_node_list_gpu_node.csv")


def pods_of(workload: str) -> list[TracePod]:
    return load_openb_pods(trace_file(f"openb_pod_list_{workload}.csv"))


def sample_pods(
    pods: Sequence[TracePod], capacity_milli: int, seed: int, ratio: float = 1.3
) -> list[TracePod]:
    """The arrival sequence for one seed (see the module docstring)."""
    rng = random.Random(seed)
    order = sorted(pods, key=lambda p: p.name)
    rng.shuffle(order)
    target = ratio * capacity_milli
    total = sum(p.total_gpu_milli for p in order)
    if total > target:
        while total > target:
            victim = order.pop(rng.randrange(len(order)))
            total -= victim.total_gpu_milli
    elif total < target:
        while True:
            pod = pods[rng.randrange(len(pods))]
            # the simulator compares with the per-GPU milli here (a quirk kept for fidelity)
            per_gpu = pod.gpu_milli if pod.num_gpu else 0
            if total + per_gpu > target:
                break
            total += pod.total_gpu_milli
            order.append(pod)
    return order


@dataclass
class Curve:
    """Allocation ratio as arrivals go on."""

    capacity_milli: int
    arrived: list[int]
    used: list[int]

    def at(self, percent: int) -> float:
        """Mean allocation ratio (%) over records whose arrived demand rounds to ``percent``."""
        cap = self.capacity_milli

        def pick(lo: int, hi: int) -> list[float]:
            return [
                round(100 * u / cap, 2)
                for a, u in zip(self.arrived, self.used, strict=True)
                if lo <= round(100 * a / cap) <= hi
            ]

        vals = pick(percent, percent) or pick(percent - 1, percent + 1)
        return round(statistics.fmean(vals), 2) if vals else float("nan")


def published(workload: str) -> dict[str, dict[int, float]]:
    """The paper's per-seed value at arrived demand = 100 %, by policy short name."""
    out: dict[str, dict[int, float]] = {}
    with open_trace_csv(trace_file("fgd_expected_allocation.csv")) as f:
        for row in csv.DictReader(f):
            if row["workload"] != f"openb_pod_list_{workload}":
                continue
            name = PAPER_POLICIES.get(row["sc_policy"], row["sc_policy"])
            out.setdefault(name, {})[int(row["seed"])] = float(row["100"])
    return out


def published_mean(workload: str, policy: str) -> float:
    vals = list(published(workload).get(policy, {}).values())
    return statistics.fmean(vals) if vals else float("nan")
