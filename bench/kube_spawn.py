"""Spawn-to-ready on Kubernetes: stock KubeSpawner vs GPUKubeSpawner, and a burst of spawns.

Both hubs run in the same run against the same dev cluster (real etcd, kube-apiserver,
kube-scheduler and controller-manager, gpulab's node agent running pods as processes), with the
same shipped config except the spawner; spawns alternate between them. Both ask for one
time-sliced GPU share (`nvidia.com/gpu.shared: 1`): stock through `extra_resource_limits`, gpulab
through a 1/8-GPU profile, so gpulab's allocation, quota check and annotations are on the timed
path. Then `--burst` users spawn at once through gpulab; a failure is a refused spawn or a server
not ready within the start timeout.

    .venv/bin/python -m bench.kube_spawn [--quick] [--rounds N] [--burst N]

A private dev cluster is started for the run (binaries from the cache; built on first use).
Last line: ratio=<gpulab p50 / stock p50> burst_failures=<n>.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

from traitlets.config import Config

from bench._spawning import alternate, percentile, print_table
from gpulab.devcluster import DevCluster, NodeSpec, ensure_binaries
from tests.harness.hub import Hub, merged
from tests.harness.kube import kube_hub_overlay

NODE = NodeSpec("bench-a100", gpus=8, sharing="time-slicing", replicas=8, cpu=256, memory_gib=2048)

COMMON = Config(
    {
        "JupyterHub": {"concurrent_spawn_limit": 200},
        "KubeSpawner": {
            "namespace": "default",
            "image": "gpulab/singleuser:dev",  # not pulled: the node agent runs cmd
            "start_timeout": 300,
            "http_timeout": 240,
            "delete_grace_period": 2,
        },
    }
)
STOCK_OVERLAY = merged(
    COMMON,
    Config(
        {
            "JupyterHub": {"spawner_class": "kubespawner.KubeSpawner"},
            "KubeSpawner": {
                "extra_resource_limits": {"nvidia.com/gpu.shared": "1"},
                "extra_resource_guarantees": {"nvidia.com/gpu.shared": "1"},
            },
        }
    ),
)
GPULAB_OVERLAY = merged(
    COMMON,
    Config(
        {
            "JupyterHub": {"spawner_class": "gpulab-kube"},
            "GPUKubeSpawner": {"gpu_sharing": "time-slicing"},
            "GPUCapacity": {
                "profiles": [{"slug": "shared-eighth", "gpus": "1/8", "default": True}]
            },
        }
    ),
)


def burst(hub: Hub, n: int, timeout: float = 300) -> tuple[int, list[float]]:
    """n users spawn at once; returns (failures, spawn-to-ready seconds of the successes)."""
    users = [f"burst{i:03d}" for i in range(n)]
    for user in users:
        hub.create_user(user)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        responses = list(pool.map(lambda u: hub.spawn(u, profile="shared-eighth"), users))
    failures = sum(r.status_code not in (201, 202) for r in responses)
    pending = {u for u, r in zip(users, responses, strict=True) if r.status_code in (201, 202)}
    ready_at: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for model in hub.api("GET", "/users", params={"state": "active"}).json():
            server = model.get("servers", {}).get("")
            if model["name"] in pending and server and server.get("ready"):
                ready_at[model["name"]] = time.perf_counter() - t0
                pending.discard(model["name"])
        time.sleep(0.5)
    failures += len(pending)
    # why: a refusal's answer, or where a server that never got ready stands
    for user, r in zip(users, responses, strict=True):
        if r.status_code not in (201, 202):
            print(f"  {user}: spawn answered {r.status_code}: {r.text[:300]}", file=sys.stderr)
    for user in sorted(pending):
        model = hub.api("GET", f"/users/{user}").json()
        server = (model.get("servers") or {}).get("") or {}
        print(
            f"  {user}: not ready after {timeout:.0f} s: pending={model.get('pending')!r}, "
            f"server={ {k: server.get(k) for k in ('ready', 'pending', 'started', 'url')} }",
            file=sys.stderr,
        )
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda u: hub.api("DELETE", f"/users/{u}/server"), users))
    return failures, sorted(ready_at.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, a burst of 10")
    parser.add_argument("--rounds", type=int, default=None, help="spawns per spawner (default 10)")
    parser.add_argument("--burst", type=int, default=None, help="concurrent spawns (default 50)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 10)
    burst_n = args.burst or (10 if args.quick else 50)

    ensure_binaries()
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-kube-") as tmp:
        root = Path(tmp)
        cluster = DevCluster(root / "cluster", log=lambda msg: None)
        cluster.up(nodes=[NODE], timeout=240)
        env = {"KUBECONFIG": str(cluster.kubeconfig)}
        # where the servers in the cluster's pods reach the hubs (not 127.0.0.1: their own)
        stock = Hub(root / "stock", kube_hub_overlay(cluster, STOCK_OVERLAY), env)
        gpulab = Hub(root / "gpulab", kube_hub_overlay(cluster, GPULAB_OVERLAY), env)
        hubs = {"stock": (stock, None), "gpulab": (gpulab, "shared-eighth")}
        try:
            for hub, _ in hubs.values():
                hub.start()
                hub.create_user("bench")
            times = alternate(hubs, rounds)
            stock.close()
            failures, burst_times = burst(gpulab, burst_n)
        finally:
            for hub, _ in hubs.values():
                hub.close()
            cluster.down()

    labels = {"stock": "KubeSpawner (stock)", "gpulab": "GPUKubeSpawner (1/8 GPU, time-sliced)"}
    ratio = print_table(labels, times, "stock", "gpulab")
    if burst_times:
        print(
            f"burst of {burst_n} concurrent spawns: {failures} failed; ready p50 "
            f"{statistics.median(burst_times):.1f} s, p95 {percentile(burst_times, 0.95):.1f} s, "
            f"last {burst_times[-1]:.1f} s"
        )
    else:
        print(f"burst of {burst_n} concurrent spawns: {failures} failed")
    print(f"ratio={ratio:.3f} burst_failures={failures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
