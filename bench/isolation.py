"""Tenant isolation, counted: the cross-user attack catalogue (tests/harness/isolation.py) against a real
embedded-default hub with per-user accounts ("local:") and against a real hub with GPUKubeSpawner
on the dev cluster ("kube:"), as one table of attempts by category.

    .venv/bin/python -m bench.isolation [--quick] [--backend local|kube|both] [--verbose]   (root)

--quick: the local backend only (no dev cluster to start), unless --backend names one.

Last line, over the backends run: attempts=<n> leaks=<n> server_errors=<n> (the goal: leaks 0,
server_errors 0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from tests.harness.cluster import running_dev_cluster
from tests.harness.dask_kube import running_dask_operator
from tests.harness.hub import Hub
from tests.harness.isolation import Attempt, local_attack_suite, table
from tests.harness.isolation_kube import kube_attack_suite, metadata_endpoint

BACKENDS = ("local", "kube")


async def run_local(tmp: Path) -> list[Attempt]:
    hub = Hub(tmp / "hub")
    try:
        hub.start()
        attempts = await local_attack_suite(hub)
    finally:
        hub.close()
        hub.cleanup()
    return [replace(a, category=f"local:{a.category}") for a in attempts]


async def run_kube(tmp: Path) -> list[Attempt]:
    # the kube e2e tests' cluster and hub config, so the bench measures what the tests assert
    from tests.harness.kube import KUBE_WORKSPACE_OVERLAY, SPAWNER_NODES, kube_hub_overlay

    with running_dev_cluster(tmp / "cluster", SPAWNER_NODES) as cluster:
        hub = Hub(
            tmp / "kube-hub",
            kube_hub_overlay(cluster, KUBE_WORKSPACE_OVERLAY),
            env={"KUBECONFIG": str(cluster.kubeconfig)},
        )
        try:
            hub.start()
            with contextlib.ExitStack() as operator:
                # the operator makes the victim's Dask cluster's pods (the Dask attempts); it
                # applies its CRDs with asyncio.run, so it starts off this loop
                log = tmp / "dask-operator.log"
                await asyncio.to_thread(operator.enter_context, running_dask_operator(cluster, log))
                with metadata_endpoint():
                    return await kube_attack_suite(hub, cluster)  # categories are "kube:" already
        finally:
            hub.close()
            hub.cleanup()


async def run(backends: list[str], verbose: bool) -> int:
    attempts: list[Attempt] = []
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-isolation-") as tmp:
        if "local" in backends:
            attempts += await run_local(Path(tmp))
        if "kube" in backends:
            attempts += await run_kube(Path(tmp))
    print(table(attempts))
    if verbose:
        for a in attempts:
            print(f"  {a.outcome}: [{a.category}] {a.name} ({a.detail})")
    leaks = sum(a.outcome == "leak" for a in attempts)
    errors = sum(a.outcome == "server_error" for a in attempts)
    print(f"attempts={len(attempts)} leaks={leaks} server_errors={errors}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="the local backend only (a few minutes)"
    )
    parser.add_argument(
        "--backend", choices=[*BACKENDS, "both"], default=None, help="default: both (quick: local)"
    )
    parser.add_argument("--verbose", action="store_true", help="list every attempt")
    return parser.parse_args(argv)


def backends_of(args: argparse.Namespace) -> list[str]:
    """The backends to attack: the one named, else both (--quick: the local one)."""
    backend = args.backend or ("local" if args.quick else "both")
    return list(BACKENDS) if backend == "both" else [backend]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.isolation: per-user accounts and the dev cluster need root")
        return 2
    return asyncio.run(run(backends_of(args), args.verbose))


if __name__ == "__main__":
    raise SystemExit(main())
