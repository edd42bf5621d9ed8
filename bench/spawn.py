"""Spawn-to-ready: JupyterHub's stock LocalProcessSpawner vs gpulab's local spawner, both running
each server as the user's own system account.

The anchor is the spawner that gives users OS-level isolation on one machine: LocalProcessSpawner,
with a system account the benchmark makes beforehand (as an admin would). gpulab's embedded default
(GPUSimpleLocalSpawner, server_accounts = 'per-user') makes its account on the user's first spawn
(the untimed warm-up; its cost is printed on its own) and on every start writes the user's key
file, prepares the home as the user and allocates a 1/4 GPU, so all of that is on the timed path.
Both hubs run side by side with the same shipped config except the spawner, and spawns alternate
between them (order flipped every round) so machine noise hits both alike. A spawn is timed from the
REST POST to the server answering as ready; servers are stopped between spawns (untimed).

    .venv/bin/python -m bench.spawn [--quick] [--rounds N]      (as root)

Last line: ratio=<gpulab p50 / stock p50>.

With --warm a third hub joins the alternation: gpulab with a warm pool of the same profile
(`GPUWarmPool`, one member), whose spawns are claims; before each the pool has refilled (untimed,
as between logins). Then the stampede: 20 users start the pool's other profile within 5 s
against a pool of 10 (the first are served warm, the rest cold; none may fail; the pool
refills). Last line: warm_ratio=<warm p50 / stock p50> warm_p95_s=.. kube_warm_ratio=..
stampede_failures=.. vscode_ok=k/20 (see bench.warm for the parts beyond the local claim;
--warm --kube-only: only the dev cluster's warm claims, last line kube_warm_ratio=..).
"""

from __future__ import annotations

import argparse
import os
import pwd
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

from traitlets.config import Config

from bench._spawning import alternate, print_table, timed_spawn
from tests.harness.hub import Hub

STOCK_OVERLAY = Config({"JupyterHub": {"spawner_class": "localprocess"}})
GPULAB_OVERLAY = Config({"GPUCapacity": {"declared_inventory": "8 x A100-SXM4-80GB"}})


def _make_system_user(name: str, home: Path) -> None:
    """The account an admin makes for LocalProcessSpawner: its own group and a private home."""
    subprocess.run(
        ["useradd", "--home-dir", str(home), "--user-group", "--shell", "/bin/bash", name],
        check=True,
    )
    home.mkdir(parents=True, mode=0o700)
    os.chown(home, *_ids(name))


def _ids(name: str) -> tuple[int, int]:
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds (about a minute)")
    parser.add_argument("--rounds", type=int, default=None, help="spawns per spawner (default 15)")
    parser.add_argument(
        "--warm", action="store_true", help="also warm pool claims, a stampede and VS Code"
    )
    parser.add_argument(
        "--kube-only",
        action="store_true",
        help="with --warm: only the dev cluster's warm claims (kube_warm_ratio)",
    )
    args = parser.parse_args(argv)
    if args.warm:
        from bench.warm import main as warm_main

        return warm_main(args.rounds or (3 if args.quick else 15), kube_only=args.kube_only)
    rounds = args.rounds or (3 if args.quick else 15)
    if os.geteuid() != 0:
        print("bench.spawn: both spawners switch to the user's account; run it as root")
        return 2

    stock_user = f"gpulab-bench-{secrets.token_hex(3)}"  # a system account of the same name
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-spawn-") as tmp:
        root = Path(tmp)
        stock = Hub(root / "stock", STOCK_OVERLAY)
        gpulab = Hub(root / "gpulab", GPULAB_OVERLAY)
        _make_system_user(stock_user, stock.state_dir / "homes" / stock_user)
        hubs = {"stock": (stock, None), "gpulab": (gpulab, "gpu-quarter")}
        users = {"stock": stock_user, "gpulab": "bench"}
        try:
            for name, (hub, _) in hubs.items():
                hub.start()
                hub.create_user(users[name])
            t0 = time.perf_counter()
            timed_spawn(gpulab, "bench", "gpu-quarter")  # makes the account: first spawn only
            first = time.perf_counter() - t0
            times = alternate(hubs, rounds, users)
        finally:
            for hub, _ in hubs.values():
                hub.close()
            for hub, _ in hubs.values():
                hub.cleanup()
            subprocess.run(["userdel", stock_user], check=False)

    labels = {
        "stock": "LocalProcessSpawner (stock, system user)",
        "gpulab": "GPUSimpleLocalSpawner (per-user account, 1/4 GPU)",
    }
    ratio = print_table(labels, times, "stock", "gpulab")
    print(f"gpulab first spawn of a new user (useradd included): {first:.3f} s")
    print(f"ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
