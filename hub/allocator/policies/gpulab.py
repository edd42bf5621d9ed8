"""gpulab's default policy: FGD made aware of memory, scarce hosts and packing, and fast.

Score of a placement (lower wins), compared lexicographically:

1. the FGD bucket (``int(100 * sigmoid(-x / scale))``) of ``x = delta + strand + pressure``:

   - ``delta``: change of the node's expected fragmentation for the workload (``frag.py``), with
     CPU *and memory* modelled, and each task kind weighted by ``(all GPUs / GPUs on nodes that
     could host it at all) ** scarcity``, so that the few nodes able to run a big job (8 GPUs,
     120 CPUs, 720 GiB) are kept whole for it;
   - ``strand``: ``strand *`` change of the node's GPU milli that its free CPU or memory can no
     longer feed at the workload's CPU/memory-per-GPU ratios (CPU-heavy work goes to CPU-rich
     nodes, leaving CPU next to the GPUs that need it);
   - ``pressure``: ``beta * milli * pressure(model)``, where a model's pressure is its share of
     the demand that can *only* run on listed models, over its share of capacity: work free to
     run anywhere stays off the models constrained work needs;

2. best-fit (least free CPU and GPU left), so equal buckets pack instead of spreading;
3. inventory order.

Latency: scores are cached per (shape, node signature); a query scores at most ``budget``
signatures it has not seen (newest first, the nodes that just changed), more only when none
of the scored ones fits. Frequent shapes are therefore always exact; rare ones may ignore a
few nodes whose state changed since they were last asked about.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import replace

from ..frag import FragModel
from ..model import MILLI
from ..state import ClusterState, Shape, Sig
from ..workload import TaskType
from .base import INFEASIBLE, Choice
from .fgd import FGD, bucket


class GpulabPolicy(FGD):
    """See the module docstring; the defaults were chosen on the openb trace (seeds 42-44)."""

    name = "gpulab"
    with_memory = True
    #: with memory in the task key, whole-node requests split into many CPU/memory sizes, each
    #: rare enough for the paper's count cut to drop: keep the kinds carrying 95 % of the GPUs
    demand_popularity = 0.95

    def __init__(
        self,
        seed: int | None = None,
        workload: Iterable[TaskType] | None = None,
        beta: float = 5.0,
        budget: int = 16,
        scale: float = 1000.0,
        strand: float = 0.5,
        scarcity: float = 1.0,
    ) -> None:
        self.scarcity = scarcity
        self._scaled_for: int | None = None
        self.strand_weight = strand
        self.beta = beta
        self.scale = scale
        self.budget = budget
        self._pressure: dict[str, float] | None = None
        super().__init__(seed, workload)

    def set_workload(self, workload: Iterable[TaskType]) -> None:
        super().set_workload(workload)
        self.raw_tasks = self.model.tasks
        self._scaled_for = None
        self._pressure = None
        tasks = self.model.tasks
        gpu = sum(t.weight * t.num_gpu * t.milli_per_gpu for t in tasks)
        #: expected CPU milli and memory MiB per milli-GPU of the workload
        self.cpu_per_gpu = sum(t.weight * t.cpu_milli for t in tasks) / gpu if gpu else 0.0
        self.mem_per_gpu = sum(t.weight * t.memory_mib for t in tasks) / gpu if gpu else 0.0

    def stranded(self, cpu_free: int, mem_free: int, gpus: tuple[int, ...]) -> float:
        """Free GPU milli the node's free CPU or memory cannot feed at the workload's ratios."""
        gpu = sum(gpus)
        if not gpu or not self.cpu_per_gpu:
            return 0.0
        fed = cpu_free / self.cpu_per_gpu
        if self.mem_per_gpu:
            fed = min(fed, mem_free / self.mem_per_gpu)
        return max(0.0, gpu - fed)

    def pressure(self, state: ClusterState) -> dict[str, float]:
        """Per model: share of constrained GPU demand over share of GPU capacity."""
        if self._pressure is None:
            cap: Counter[str] = Counter(g.model for n in state.inventory.nodes for g in n.gpus)
            total_cap = sum(cap.values())
            demand: dict[str, float] = dict.fromkeys(cap, 0.0)
            total = 0.0
            for t in self.raw_tasks:
                gpu = t.weight * t.num_gpu * t.milli_per_gpu
                total += gpu
                allowed = [m for m in t.models if m in cap]
                for m in allowed:
                    demand[m] += gpu / len(allowed)
            self._pressure = {
                m: (demand[m] / total) / (cap[m] / total_cap) if total else 0.0 for m in cap
            }
        return self._pressure

    def scale_by_scarcity(self, state: ClusterState) -> None:
        """Weigh each task kind by how few GPUs could host it at all: ``(all GPUs / GPUs on
        nodes whose empty state fits it) ** scarcity``. A task only a handful of nodes can take
        (8 GPUs with 120 CPUs) then counts enough for FGD to keep those nodes whole for it."""
        if self._scaled_for == id(state) or not self.scarcity or not self.raw_tasks:
            return
        self._scaled_for = id(state)
        counts = Counter(state.class_of)
        cap = [len(c.models) * counts[k] for k, c in enumerate(state.classes)]
        total = sum(cap) or 1
        scaled = []
        for t in self.raw_tasks:
            room = sum(
                cap[k]
                for k, c in enumerate(state.classes)
                if c.cpu_milli >= t.cpu_milli
                and c.memory_mib >= t.memory_mib
                and sum(1 for m in c.models if not t.models or m in t.models) >= t.num_gpu
            )
            factor = (total / room) ** self.scarcity if room and t.num_gpu else 1.0
            scaled.append(replace(t, weight=t.weight * factor))
        self.model = FragModel(scaled, with_memory=self.with_memory)
        self.invalidate()

    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        d = self.delta(state, sig, shape, option)
        take = state.taken(sig, shape, option)
        w = self.strand_weight
        if w:
            after = state.after(sig, shape, option)
            d += w * (
                self.stranded(after[1], after[2], after[3]) - self.stranded(sig[1], sig[2], sig[3])
            )
        if option and self.beta:
            model = state.classes[sig[0]].models[option[0]]
            d += self.beta * take * len(option) * self.pressure(state).get(model, 0.0)
        cpu_left = sig[1] - shape[0]
        gpu_left = sum(sig[3]) - take * len(option)
        fit = 0.5 * cpu_left / state.max_cpu_milli + 0.5 * gpu_left / state.max_gpu_milli
        own = (sig[3][option[0]] - take) / MILLI if option else 0.0
        return -float(bucket(d, self.scale)) + 0.4 * fit + 1e-9 * own

    def choose(
        self, state: ClusterState, shape: Shape, nodes: Collection[int] | None = None
    ) -> Choice | None:
        self.scale_by_scarcity(state)
        if nodes is not None:
            return self._choose_among(state, shape, nodes)
        per = self.shape_cache(state, shape)
        scores = per.scores
        best_score = INFEASIBLE
        winners: list[int] = []
        misses: list[int] = []
        for sid in state.candidates(shape):
            s = scores.get(sid)
            if s is None:
                misses.append(sid)
            elif s < best_score:
                best_score = s
                winners = [sid]
            elif s == best_score and s != INFEASIBLE:
                winners.append(sid)
        if misses:
            misses.sort(reverse=True)  # newest signatures first
            scored = 0
            for sid in misses:
                if scored >= self.budget and winners:
                    break
                s = self.fill(state, per, sid, shape)
                if s == INFEASIBLE:
                    continue
                scored += 1
                if s < best_score:
                    best_score = s
                    winners = [sid]
                elif s == best_score:
                    winners.append(sid)
        return self._pick(state, per, winners)
