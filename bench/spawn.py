"""Spawn-to-ready: JupyterHub's stock SimpleLocalProcessSpawner vs gpulab's local spawner.

Both hubs run side by side in the same run, with the same shipped config except the spawner, and
spawns alternate between them (order flipped every round) so machine noise hits both alike. A
spawn is timed from the REST POST to the server answering as ready; servers are stopped between
spawns (untimed). gpulab spawns a 1/4-GPU profile, so allocation, environment and the caps hook are
all on the timed path.

    .venv/bin/python -m bench.spawn [--quick] [--rounds N]

Last line: ratio=<gpulab p50 / stock p50>.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tests.hubtools import Hub

STOCK_OVERLAY = """
import os
c.JupyterHub.spawner_class = 'simple'
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r}
if os.geteuid() == 0:
    c.Spawner.args = ['--allow-root']
"""
GPULAB_OVERLAY = "c.GPUCapacity.declared_inventory = '8 x A100-SXM4-80GB'\n"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _timed_spawn(hub: Hub, user: str, profile: str | None) -> float:
    t0 = time.perf_counter()
    r = hub.spawn(user, profile=profile)
    if r.status_code not in (201, 202):
        raise RuntimeError(f"spawn failed: {r.status_code} {r.text}")
    if r.status_code == 202:
        hub.wait_ready(user)
    elapsed = time.perf_counter() - t0
    hub.stop_server(user)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds (about a minute)")
    parser.add_argument("--rounds", type=int, default=None, help="spawns per spawner (default 15)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)

    with tempfile.TemporaryDirectory(prefix="gpulab-bench-spawn-") as tmp:
        root = Path(tmp)
        stock = Hub(
            root / "stock", STOCK_OVERLAY.format(homes=str(root / "stock" / "homes" / "{username}"))
        )
        gpulab = Hub(root / "gpulab", GPULAB_OVERLAY)
        hubs = {"stock": (stock, None), "gpulab": (gpulab, "gpu-quarter")}
        times: dict[str, list[float]] = {"stock": [], "gpulab": []}
        try:
            for hub, _ in hubs.values():
                hub.start()
                hub.create_user("bench")
            # one untimed warm-up each: first imports fill the page cache
            for hub, profile in hubs.values():
                _timed_spawn(hub, "bench", profile)
            for i in range(rounds):
                order = ["stock", "gpulab"] if i % 2 == 0 else ["gpulab", "stock"]
                for name in order:
                    hub, profile = hubs[name]
                    times[name].append(_timed_spawn(hub, "bench", profile))
        finally:
            for hub, _ in hubs.values():
                hub.close()

    rows = []
    for name in ("stock", "gpulab"):
        t = times[name]
        rows.append((name, len(t), statistics.median(t), _percentile(t, 0.95), max(t)))
    ratio_p50 = rows[1][2] / rows[0][2]
    ratio_p95 = rows[1][3] / rows[0][3]
    print(f"{'spawner':<34} {'n':>3} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    labels = {
        "stock": "SimpleLocalProcessSpawner (stock)",
        "gpulab": "GPUSimpleLocalSpawner (1/4 GPU)",
    }
    for name, n, p50, p95, mx in rows:
        print(f"{labels[name]:<34} {n:>3} {p50:>7.3f} {p95:>7.3f} {mx:>7.3f}")
    print(f"{'ratio gpulab/stock':<34} {'':>3} {ratio_p50:>7.3f} {ratio_p95:>7.3f}")
    print(f"ratio={ratio_p50:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
