"""Churn replay: pods arrive and leave by the openb trace's creation and deletion times.

The FGD paper's method (``_openb.py``) only fills a cluster; a live cluster also frees GPUs, so
fragmentation is also a matter of what leaves. Here every GPU pod of a trace arrives at its
``creation_time`` and runs for ``deletion_time - creation_time`` once placed. A pod that does
not fit waits in a FIFO queue; whenever GPUs are freed the queue is tried in order (a pod that
still does not fit is skipped, so later smaller pods may go first, as Kubernetes' scheduling
queue would). A pod still waiting at its own deletion time gives up.

The trace's cluster is far bigger than its concurrent demand (a peak of ~66 GPUs on 6,212; all
its GPU pods together ask for less than the cluster has), so the replay runs on a quarter of the
nodes, taken every 4th within each GPU model (the model mix stays the trace's), and the run times
are stretched by one factor until the peak concurrent demand is `pressure` times that slice's
GPUs: contended, so that policies can differ. The trace's arrivals are back-loaded (10 % of its
pods arrive in the first 80 % of its time), so the allocation ratio is averaged over a window the
trace alone fixes, the same for every policy: from the first time the offered demand (every pod
placed on arrival) reaches half the slice, to the last arrival (``contended_window``); and over
the saturated part, from its first reaching the whole slice. After a departure the scheduler tries
at most `QUEUE_BUDGET` waiting pods (a scheduling cycle's budget; otherwise every departure would
retry thousands). Reported per policy: the time-weighted mean GPU allocation ratio (allocated
milli / capacity) over those windows, its value at a few points in time, and queueing delay
(median and p95 of the waits of the pods that were placed; how many waited at all; pods that gave
up).
"""

from __future__ import annotations

import bisect
import csv
import heapq
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpulab.hub.allocator import AllocationError, Allocator, Inventory, Node, Policy
from gpulab.hub.allocator.openb import TracePod, open_trace_csv

from ._openb import pods_of, trace_file


@dataclass(frozen=True)
class TimedPod:
    pod: TracePod
    arrival: int
    duration: int


@dataclass
class ChurnResult:
    policy: str
    capacity_milli: int
    #: (time, allocated milli from then on), one entry per change, in time order
    steps: list[tuple[int, int]] = field(default_factory=list)
    waits: list[int] = field(default_factory=list)  # seconds waited by the pods that were placed
    gave_up: int = 0
    placed: int = 0

    def mean_ratio(self, window: tuple[int, int]) -> float:
        """Time-weighted mean of allocated / capacity (%) over ``window``."""
        start, end = window
        if end <= start:
            return self.ratio_at(start)
        area = 0.0
        for k, (when, used) in enumerate(self.steps):
            until = self.steps[k + 1][0] if k + 1 < len(self.steps) else end
            lo, hi = max(when, start), min(until, end)
            if hi > lo:
                area += used * (hi - lo)
        return 100 * area / (self.capacity_milli * (end - start))

    def ratio_at(self, when: int) -> float:
        """Allocated / capacity (%) at ``when`` (after every event at that second)."""
        k = bisect.bisect_right(self.steps, (when, sys.maxsize))
        return 100 * self.steps[k - 1][1] / self.capacity_milli if k else 0.0

    def samples(self, window: tuple[int, int]) -> list[float]:
        """The ratio at 10/25/50/75/90 % of ``window``."""
        start, end = window
        return [self.ratio_at(round(start + f * (end - start))) for f in SAMPLE_AT]

    @property
    def waited(self) -> int:
        """Pods placed only after waiting in the queue."""
        return sum(1 for w in self.waits if w > 0)

    def wait_p(self, q: float, waiters_only: bool = False) -> float:
        """The ``q`` quantile of the waits (of the pods that waited at all, with waiters_only)."""
        ordered = sorted(w for w in self.waits if w > 0 or not waiters_only)
        if not ordered:
            return 0.0
        return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


SAMPLE_AT = (0.1, 0.25, 0.5, 0.75, 0.9)


def timed_pods(workload: str) -> list[TimedPod]:
    """The trace's GPU pods with their arrival and run time (seconds of the trace's clock)."""
    times: dict[str, tuple[int, int]] = {}
    with open_trace_csv(trace_file(f"openb_pod_list_{workload}.csv")) as f:
        for row in csv.DictReader(f):
            times[row["name"]] = (int(row["creation_time"]), int(row["deletion_time"]))
    out = []
    for pod in pods_of(workload):
        created, deleted = times[pod.name]
        if pod.total_gpu_milli and deleted > created:
            out.append(TimedPod(pod, created, deleted - created))
    return sorted(out, key=lambda t: (t.arrival, t.pod.name))


def peak_demand(pods: Sequence[TimedPod]) -> int:
    """The most GPU milli the trace's pods ask for at once, were every pod placed on arrival."""
    events = sorted(
        [(t.arrival, t.pod.total_gpu_milli) for t in pods]
        + [(t.arrival + t.duration, -t.pod.total_gpu_milli) for t in pods]
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


QUEUE_BUDGET = 64


def cluster_slice(nodes: Sequence[Node], every: int = 4) -> Inventory:
    """Every `every`-th node within each GPU model group (CPU-only nodes too), trace order."""
    groups: dict[str, list[Node]] = {}
    for node in nodes:
        groups.setdefault(node.gpus[0].model if node.gpus else "", []).append(node)
    return Inventory([n for group in groups.values() for n in group[::every]])


def stretched(pods: Sequence[TimedPod], capacity_milli: int, pressure: float) -> list[TimedPod]:
    """The pods with run times multiplied so that peak demand is about pressure x capacity."""
    factor = 1.0
    for _ in range(8):  # peak demand grows about linearly with the factor
        peak = peak_demand([TimedPod(t.pod, t.arrival, round(t.duration * factor)) for t in pods])
        ratio = pressure * capacity_milli / max(1, peak)
        if abs(ratio - 1) < 0.02:
            break
        factor *= ratio
    return [TimedPod(t.pod, t.arrival, max(1, round(t.duration * factor))) for t in pods]


def contended_window(
    pods: Sequence[TimedPod], capacity_milli: int, level: float = 0.5
) -> tuple[int, int]:
    """From the first time the offered demand (every pod placed on arrival) reaches ``level`` x
    capacity to the last arrival: fixed by the trace, the same for every policy."""
    events = sorted(
        [(t.arrival, t.pod.total_gpu_milli) for t in pods]
        + [(t.arrival + t.duration, -t.pod.total_gpu_milli) for t in pods]
    )
    last = max(t.arrival for t in pods)
    demand = 0
    for when, delta in events:
        demand += delta
        if demand >= level * capacity_milli:
            return min(when, last), last
    return last, last  # never that contended: an empty window


def arrival_window(pods: Sequence[TimedPod]) -> tuple[int, int]:
    """First to last arrival."""
    return min(t.arrival for t in pods), max(t.arrival for t in pods)


def replay_churn(
    inventory: Inventory, pods: Sequence[TimedPod], policy: Callable[[], Policy], name: str
) -> ChurnResult:
    """Replay ``pods`` through an allocator with ``policy``; FIFO queue, give-ups (see above)."""
    alloc = Allocator(inventory, policy=policy(), seed=0)
    # events: (time, order, kind, index); departures before arrivals at the same second
    events: list[tuple[int, int, int, int]] = [(t.arrival, 1, 0, i) for i, t in enumerate(pods)]
    heapq.heapify(events)
    queue: list[int] = []  # indices of waiting pods, in arrival order
    started: dict[int, int] = {}
    result = ChurnResult(name, inventory.total_gpu_milli)

    def try_place(i: int, now: int) -> bool:
        try:
            alloc.place(pods[i].pod.to_request(f"p{i}"))
        except AllocationError:
            return False
        started[i] = now
        result.waits.append(now - pods[i].arrival)
        heapq.heappush(events, (now + pods[i].duration, 0, 1, i))
        return True

    while events:
        now, _, kind, i = heapq.heappop(events)
        if kind == 0:  # arrival: the scheduler tries every new pod, then it waits its turn
            if not try_place(i, now):
                queue.append(i)
        elif i in started:  # departure of a running pod: free it, then serve the queue
            alloc.release(f"p{i}")
            still = []
            for k, j in enumerate(queue):
                if pods[j].arrival + pods[j].duration <= now:
                    result.gave_up += 1  # its own end came while it waited
                elif k >= QUEUE_BUDGET or not try_place(j, now):
                    still.append(j)
            queue = still
        used = alloc.used_gpu_milli
        if result.steps and result.steps[-1][0] == now:
            result.steps[-1] = (now, used)
        elif not result.steps or result.steps[-1][1] != used:
            result.steps.append((now, used))
    result.gave_up += len(queue)
    result.placed = len(started)
    return result


def summary(
    results: Sequence[ChurnResult], window: tuple[int, int], saturated: tuple[int, int]
) -> list[str]:
    """A markdown table: allocation over the contended and the saturated window, queueing."""
    lines = [
        "| policy | mean GPU alloc %, contended | saturated | at 10/25/50/75/90 % of contended "
        "| placed | of which waited | gave up | wait p50 s | wait p95 s | p50 s of those who waited |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        points = "/".join(f"{v:.1f}" for v in r.samples(window))
        lines.append(
            f"| {r.policy} | {r.mean_ratio(window):.2f} | {r.mean_ratio(saturated):.2f} "
            f"| {points} | {r.placed} | {r.waited} | {r.gave_up} "
            f"| {r.wait_p(0.5):.0f} | {r.wait_p(0.95):.0f} | {r.wait_p(0.5, waiters_only=True):.0f} |"
        )
    return lines
