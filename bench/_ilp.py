"""Optimality check: offline placement of a small instance solved exactly as an ILP (HiGHS).

The ILP picks which pods to admit and where, maximising allocated GPU milli, with every pod on
one node, CPU/memory/GPU capacities, model constraints, whole idle GPUs for whole-GPU pods and
fractions packed per GPU. Pods of one shape are interchangeable, so variables count pods of a
shape per (node, GPU). It knows all pods in advance and is warm-started from the online
placement; the gap is what an omniscient placement could still gain.
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from gpulab.hub.allocator import MILLI, Allocator, Inventory, Node
from gpulab.hub.allocator.openb import TracePod

PodShape = tuple[int, int, int, int, frozenset[str]]  # cpu, mem, num_gpu, milli, models


@dataclass
class IlpResult:
    objective: float  # best admitted GPU milli found
    bound: float  # proven upper bound
    optimal: bool
    seconds: float


def sample_instance(
    nodes: Sequence[Node], pods: Sequence[TracePod], n_nodes: int, seed: int
) -> tuple[Inventory, list[TracePod]]:
    """``n_nodes`` random nodes and shuffled trace pods up to 100 % of their GPU capacity."""
    rng = random.Random(seed)
    inv = Inventory(rng.sample(list(nodes), n_nodes))
    order = list(pods)
    rng.shuffle(order)
    out: list[TracePod] = []
    arrived = 0
    for p in order:
        if arrived + p.total_gpu_milli > inv.total_gpu_milli:
            continue
        out.append(p)
        arrived += p.total_gpu_milli
        if arrived >= inv.total_gpu_milli * 0.995:
            break
    return inv, out


def _shape(p: TracePod) -> PodShape:
    frac = p.num_gpu == 1 and p.gpu_milli < MILLI
    return (p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli if frac else MILLI, p.gpu_spec)


def solve(
    inv: Inventory,
    pods: Sequence[TracePod],
    time_limit: float = 10.0,
    start: Allocator | None = None,
) -> IlpResult:
    """Maximise admitted GPU milli of ``pods`` on ``inv`` (see the module docstring)."""
    counts = Counter(_shape(p) for p in pods)
    shapes = sorted(counts, key=lambda s: (s[2], s[3], s[0], s[1], sorted(s[4])))
    cost: list[float] = []
    upper: list[float] = []
    entries: list[list[tuple[int, float]]] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(a: float, b: float) -> int:
        lo.append(a)
        hi.append(b)
        return len(lo) - 1

    def col(c: float, ub: float, e: list[tuple[int, float]]) -> int:
        cost.append(c)
        upper.append(ub)
        entries.append(e)
        return len(cost) - 1

    nodes = inv.nodes
    shape_row = [row(0, counts[s]) for s in shapes]
    cpu_row = [row(0, n.cpu_milli) for n in nodes]
    mem_row = [row(0, n.memory_mib) for n in nodes]
    whole_row = [row(0, 0) for _ in nodes]  # sum_k w_nk == GPUs taken by whole-GPU pods
    gpu_row = [[row(-np.inf, float(MILLI)) for _ in n.gpus] for n in nodes]
    w_col: list[list[int]] = []
    for ni, n in enumerate(nodes):
        cols = []
        for k in range(len(n.gpus)):
            c = col(0.0, 1.0, [(whole_row[ni], -1.0), (gpu_row[ni][k], float(MILLI))])
            if cols:  # symmetry: whole-GPU pods take the lowest GPUs
                r = row(0, np.inf)
                entries[cols[-1]].append((r, 1.0))
                entries[c].append((r, -1.0))
            cols.append(c)
        w_col.append(cols)
    var: dict[tuple[int, int, int], int] = {}  # (shape, node, gpu or -1) -> column
    for si, (cpu, mem, num, milli, models) in enumerate(shapes):
        for ni, n in enumerate(nodes):
            if cpu > n.cpu_milli or mem > n.memory_mib:
                continue
            allowed = [k for k, g in enumerate(n.gpus) if not models or g.model in models]
            base = [(shape_row[si], 1.0), (cpu_row[ni], float(cpu)), (mem_row[ni], float(mem))]
            ub = float(counts[shapes[si]])
            if not num:
                var[(si, ni, -1)] = col(0.0, ub, base)
            elif milli < MILLI:
                for k in allowed:
                    var[(si, ni, k)] = col(
                        float(milli),
                        min(ub, MILLI // milli),
                        base + [(gpu_row[ni][k], float(milli))],
                    )
            elif len(allowed) == len(n.gpus) and len(n.gpus) >= num:
                var[(si, ni, -1)] = col(
                    float(num * MILLI),
                    min(ub, len(n.gpus) // num),
                    base + [(whole_row[ni], float(num))],
                )
    n_cols = len(cost)
    h = _quiet_highs()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 1e-4)
    h.setOptionValue("threads", 1)
    h.addRows(
        len(lo),
        np.array(lo),
        np.array(hi),
        0,
        np.zeros(len(lo), dtype=np.int32),
        np.array([], dtype=np.int32),
        np.array([]),
    )
    starts, index, value = [], [], []
    for e in entries:
        starts.append(len(index))
        for r, v in e:
            index.append(r)
            value.append(v)
    h.addCols(
        n_cols,
        np.array(cost),
        np.zeros(n_cols),
        np.array(upper),
        len(index),
        np.array(starts, dtype=np.int32),
        np.array(index, dtype=np.int32),
        np.array(value),
    )
    h.changeColsIntegrality(
        n_cols,
        np.arange(n_cols, dtype=np.int32),
        np.array([highspy.HighsVarType.kInteger] * n_cols),
    )
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    if start is not None:
        _warm_start(h, inv, shapes, var, w_col, start, n_cols)
    h.run()
    info = h.getInfo()
    obj = float(info.objective_function_value)
    bound = float(info.mip_dual_bound)
    optimal = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return IlpResult(obj, max(bound, obj), optimal, float(h.getRunTime()))


def _quiet_highs() -> highspy.Highs:
    """A HiGHS instance that does not print its banner (unless GPULAB_ILP_LOG is set)."""
    if os.environ.get("GPULAB_ILP_LOG"):
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    return h


def _warm_start(
    h: highspy.Highs,
    inv: Inventory,
    shapes: list[PodShape],
    var: dict[tuple[int, int, int], int],
    w_col: list[list[int]],
    alloc: Allocator,
    n_cols: int,
) -> None:
    """Give HiGHS the online placement as an incumbent."""
    index = {s: i for i, s in enumerate(shapes)}
    uuid_pos = {g.uuid: (ni, k) for ni, n in enumerate(inv.nodes) for k, g in enumerate(n.gpus)}
    x = np.zeros(n_cols)
    placements = alloc.allocations()
    # a node's GPUs are interchangeable: renumber them so whole-GPU pods hold the lowest ones
    whole_gpus: dict[int, list[int]] = {}
    for p in placements:
        if p.request.num_gpu:
            ni = inv.index_of(p.node)
            assert ni is not None
            whole_gpus.setdefault(ni, []).extend(uuid_pos[s.uuid][1] for s in p.gpus)
    renumber: dict[int, dict[int, int]] = {}
    for ni, n in enumerate(inv.nodes):
        first = sorted(whole_gpus.get(ni, []))
        rest = [k for k in range(len(n.gpus)) if k not in first]
        renumber[ni] = {old: new for new, old in enumerate(first + rest)}
        for k in range(len(first)):
            x[w_col[ni][k]] = 1
    for p in placements:
        r = p.request
        frac = bool(r.gpu_milli)
        shape = (
            r.cpu_milli,
            r.memory_mib,
            1 if frac else r.num_gpu,
            r.gpu_milli if frac else MILLI,
            r.gpu_models,
        )
        ni = inv.index_of(p.node)
        assert ni is not None
        if frac:
            key = (index[shape], ni, renumber[ni][uuid_pos[p.gpus[0].uuid][1]])
        elif r.num_gpu:
            key = (index[shape], ni, -1)
        else:
            key = (index[shape], ni, -1)
        x[var[key]] += 1
    sol = highspy.HighsSolution()
    sol.col_value = list(x)
    sol.value_valid = True
    h.setSolution(sol)
