"""bench.dask's measurement and its table: rounds that alternate a backend's two sides, each timed
the same way (cluster-up, scale 0->N, N->0), the leaks looked for after them, and the rows.

Apart from the sides (`bench.dask_sides`, `bench.dask_kube`) and the run (`bench.dask`) because it
knows nothing of either side: it drives the `Side` and `Running` protocols alone, so both
backends are measured and printed by the same code.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from bench._spawning import percentile
from bench.dask_sides import Leftovers, Running, Side, wait_count


@dataclass
class Times:
    up: list[float] = field(default_factory=list)
    scale_up: list[float] = field(default_factory=list)
    scale_down: list[float] = field(default_factory=list)
    #: part of cluster-up: until the scheduler answers (gpulab's side: its credentials)
    scheduler: list[float] = field(default_factory=list)
    left: list[Leftovers] = field(default_factory=list)
    #: the warm-up's cluster-up: the run's first cluster (gpulab's side starts the owner's fork
    #: server with it; the anchor imports the dashboard with it)
    first_up: list[float] = field(default_factory=list)


@dataclass
class Backend:
    """One backend's two sides and what they measured."""

    title: str
    sides: list[Side] = field(default_factory=list)
    times: dict[str, Times] = field(default_factory=dict)
    leaked: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    note: str = ""  # why it was not measured
    #: side name -> why that side was not measured
    missing: dict[str, str] = field(default_factory=dict)


def unscalable(side: Side) -> str:
    """Why `side`'s scaling cannot be measured where it runs ('' when it can): its rounds then
    time cluster-up and shutdown only, and its scale rows say why."""
    return str(getattr(side, "unscalable", ""))


def timed(step: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def scale_to(cluster: Running, n: int, what: str) -> None:
    cluster.scale(n)
    wait_count(cluster, n, what)


def one_round(side: Side, n: int) -> tuple[tuple[float, float, float, float | None], Leftovers]:
    """Up to ``n``, down to 0, 0->n, n->0, shutdown: (up, 0->n, n->0, scheduler answering)
    seconds (the last None where the side does not tell), leftovers."""
    holder: list[Running] = []

    def up() -> None:
        holder.append(side.up(n))
        wait_count(holder[0], n, f"{side.label}: cluster-up")

    scale_up_s = scale_down_s = None
    try:
        up_s = timed(up)
        cluster = holder[0]
        if not unscalable(side):
            cluster.record()
            cluster.scale(0)
            wait_count(cluster, 0, f"{side.label}: settle at 0")
            cluster.settle()
            scale_up_s = timed(lambda: scale_to(cluster, n, f"{side.label}: scale 0->N"))
            cluster.record()
            scale_down_s = timed(lambda: scale_to(cluster, 0, f"{side.label}: scale N->0"))
    except BaseException:
        if holder:
            with suppress(Exception):
                holder[0].close()
        raise
    scheduler_s = getattr(cluster, "scheduler_s", None)
    return (up_s, scale_up_s, scale_down_s, scheduler_s), cluster.close()


def measure(backend: Backend, n: int, rounds: int, leak_wait: float) -> None:
    """Warm-ups, then ``rounds`` alternating rounds; then the leaks, ``leak_wait`` s after the
    last shutdown (a warm-up's leftovers count too)."""
    for side in list(backend.sides):
        try:
            (first_up, *_), left = one_round(side, n)
        except Exception as e:  # the table says why; the other side is still measured
            backend.missing[side.name] = f"the warm-up failed: {type(e).__name__}: {e}"[:300]
            backend.sides.remove(side)
            continue
        backend.times[side.name] = Times(left=[left], first_up=[first_up])
    for i in range(rounds):
        order = backend.sides if i % 2 == 0 else list(reversed(backend.sides))
        for side in order:
            if side not in backend.sides:
                continue  # it failed a round before
            try:
                (up_s, scale_up_s, scale_down_s, scheduler_s), left = one_round(side, n)
            except Exception as e:  # as a warm-up's: the table says why, the other side goes on
                why = f"round {i + 1} of {rounds} failed: {type(e).__name__}: {e}"[:300]
                backend.missing[side.name] = why
                backend.sides.remove(side)
                del backend.times[side.name]
                continue
            times = backend.times[side.name]
            times.up.append(up_s)
            if scale_up_s is not None and scale_down_s is not None:
                times.scale_up.append(scale_up_s)
                times.scale_down.append(scale_down_s)
            if scheduler_s is not None:
                times.scheduler.append(scheduler_s)
            times.left.append(left)
    last = max((s.shut_at for t in backend.times.values() for s in t.left), default=0.0)
    time.sleep(max(0.0, last + leak_wait - time.time()))
    for side in backend.sides:
        backend.leaked[side.name] = side.leaked(backend.times[side.name].left)


# -- the table -------------------------------------------------------------------------------------


def _stats(values: list[float]) -> str:
    if not values:
        return f"{0:>4} {'':>8} {'':>8} {'':>8}"
    return (
        f"{len(values):>4} {statistics.median(values):>8.3f} {percentile(values, 0.95):>8.3f} "
        f"{max(values):>8.3f}"
    )


WIDTH = 80


def print_backend(backend: Backend, n: int) -> float | None:
    """The backend's rows; returns its cluster-up ratio (gpulab p50 / anchor p50) or None."""
    if backend.note:
        for what in ("cluster-up", "scale 0->N", "scale N->0"):
            print(
                f"{backend.title + ': ' + what:<{WIDTH}} {_stats([])}  not measured: {backend.note}"
            )
        print(f"{backend.title + ': leaked after shutdown':<{WIDTH}} {'n/a':>4}")
        return None
    labels = {s.name: s.label for s in backend.sides}
    up_ratio: float | None = None
    for what, pick in (
        (f"cluster-up to {n} workers", lambda t: t.up),
        (f"scale 0->{n}", lambda t: t.scale_up),
        (f"scale {n}->0", lambda t: t.scale_down),
    ):
        scaling = not what.startswith("cluster-up")
        why_not = {s.name: unscalable(s) for s in backend.sides if scaling and unscalable(s)}
        for name in ("anchor", "gpulab"):
            if name in backend.missing or name in why_not:
                label = f"{backend.title}: {what}, {labels.get(name, name)}"
                why = backend.missing.get(name) or why_not[name]
                print(f"{label:<{WIDTH}} {_stats([])}  not measured: {why}")
            else:
                label = f"{backend.title}: {what}, {labels[name]}"
                print(f"{label:<{WIDTH}} {_stats(pick(backend.times[name]))}")
        if not backend.missing and not why_not:
            a, g = pick(backend.times["anchor"]), pick(backend.times["gpulab"])
            p50 = statistics.median(g) / statistics.median(a)
            p95 = percentile(g, 0.95) / percentile(a, 0.95)
            print(
                f"{backend.title + ': ' + what + ', ratio gpulab/anchor':<{WIDTH}} "
                f"{'':>4} {p50:>8.3f} {p95:>8.3f}"
            )
            if what.startswith("cluster-up"):
                up_ratio = p50
        if what.startswith("cluster-up") and "gpulab" in backend.times:
            label = f"{backend.title}: {what}, gpulab: of it, POST to scheduler answering"
            print(f"{label:<{WIDTH}} {_stats(backend.times['gpulab'].scheduler)}")
            for name, times in backend.times.items():
                label = f"{backend.title}: {what}, the run's first (warm-up), {labels[name]}"
                print(f"{label:<{WIDTH}} {_stats(times.first_up)}")
    for name, (count, lines) in backend.leaked.items():
        shut = len(backend.times[name].left)
        print(
            f"{backend.title + ': leaked after shutdown, ' + labels[name]:<{WIDTH}} "
            f"{count:>4}  of {shut - 1} timed clusters and 1 warm-up; target 0"
        )
        for line in lines[:20]:
            print(f"    {line}")
    return up_ratio
