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
import tempfile
from pathlib import Path

from bench._spawning import alternate, print_table
from tests.hubtools import Hub

STOCK_OVERLAY = """
import os
c.JupyterHub.spawner_class = 'simple'
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r}
if os.geteuid() == 0:
    c.Spawner.args = ['--allow-root']
"""
GPULAB_OVERLAY = "c.GPUCapacity.declared_inventory = '8 x A100-SXM4-80GB'\n"


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
        try:
            for hub, _ in hubs.values():
                hub.start()
                hub.create_user("bench")
            times = alternate(hubs, rounds)
        finally:
            for hub, _ in hubs.values():
                hub.close()

    labels = {
        "stock": "SimpleLocalProcessSpawner (stock)",
        "gpulab": "GPUSimpleLocalSpawner (1/4 GPU)",
    }
    ratio = print_table(labels, times, "stock", "gpulab")
    print(f"ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
