"""Shared by the spawn benchmarks: timed spawns through a real hub, summary statistics."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from tests.harness.hub import Hub


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def timed_spawn(hub: Hub, user: str, profile: str | None, timeout: float = 180) -> float:
    """Seconds from the REST POST to the server answering as ready; the server is then stopped."""
    t0 = time.perf_counter()
    r = hub.spawn(user, profile=profile)
    if r.status_code not in (201, 202):
        raise RuntimeError(f"spawn failed: {r.status_code} {r.text}")
    if r.status_code == 202:
        hub.wait_ready(user, timeout=timeout)
    elapsed = time.perf_counter() - t0
    hub.stop_server(user, timeout=timeout)
    return elapsed


def alternate(
    hubs: dict[str, tuple[Hub, str | None]],
    rounds: int,
    users: dict[str, str] | None = None,
) -> dict[str, list[float]]:
    """One untimed warm-up each, then `rounds` timed spawns each, order flipped every round.
    `users`: the hub user spawning on each hub (default 'bench')."""
    names = list(hubs)
    user = {name: (users or {}).get(name, "bench") for name in names}
    for name, (hub, profile) in hubs.items():
        timed_spawn(hub, user[name], profile)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            hub, profile = hubs[name]
            times[name].append(timed_spawn(hub, user[name], profile))
    return times


def print_table(
    labels: dict[str, str], times: dict[str, list[float]], anchor: str, ours: str
) -> float:
    """Print n/p50/p95/max per spawner and the ratio row; return the p50 ratio ours/anchor."""
    width = max(len(v) for v in labels.values()) + 2
    print(f"{'spawner':<{width}} {'n':>3} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    for name, label in labels.items():
        t = times[name]
        print(
            f"{label:<{width}} {len(t):>3} {statistics.median(t):>7.3f} {percentile(t, 0.95):>7.3f} {max(t):>7.3f}"
        )
    p50 = statistics.median(times[ours]) / statistics.median(times[anchor])
    p95 = percentile(times[ours], 0.95) / percentile(times[anchor], 0.95)
    print(f"{'ratio ' + ours + '/' + anchor:<{width}} {'':>3} {p50:>7.3f} {p95:>7.3f}")
    return p50
