"""Warm pool claims against cold starts (`python -m bench.spawn --warm`, as root).

Three hubs side by side, spawns alternating (order rotated every round), each timed from the
REST POST to the server answering as ready:
- stock: JupyterHub's LocalProcessSpawner, the server running as a system user made beforehand
  (the anchor of bench.spawn);
- gpulab cold: GPUSimpleLocalSpawner, per-user account, 1/4 GPU, workspaces on;
- gpulab warm: the same with a warm pool of that profile (one member). Before each of its spawns
  the pool has refilled (untimed: between two logins of a real hub the pool refills too).

Then the stampede, on the warm hub: 20 returning users (each started a CPU server once before,
untimed, so their accounts exist) start its 1/8-GPU profile within 5 s against a pool
of 10 members. The first are served warm, the others cold; no start may fail; the pool must be
back to 10 ready members afterwards. Then VS Code's request sequence (tests.harness.vscode), 20
times against the warm hub: an empty-body start of the named server called like the pool's
profile (gpulab's named-server convention), a cell that must see the GPU share, a stop.

Then the dev cluster (bench.kube_spawn's setup: a private cluster, real control plane, gpulab's
node agent): stock KubeSpawner asking for one whole GPU against GPUKubeSpawner with a one-member
warm pool of a one-GPU profile, alternating; before each warm spawn the pool has a Running member
pod (untimed). A claim there saves what a real cluster waits for before a pod runs (node
scale-up, image pull, device plugin), none of which the dev cluster has, so kube_warm_ratio near
1.0 is the expected figure. It is n/a, with the reason on the line before the last, when the
cluster's binaries cannot be built. `--kube-only` (bench.spawn --warm --kube-only) runs this
part alone.

Last line: warm_ratio=<warm p50 / stock p50> warm_p95_s=<warm p95> kube_warm_ratio=<x|n/a>
stampede_failures=<n> vscode_ok=<k>/20
"""

from __future__ import annotations

import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from traitlets.config import Config

from bench._lastline import print_last_lines
from bench._spawning import percentile, print_table, timed_spawn
from bench.spawn import GPULAB_OVERLAY, STOCK_OVERLAY, _make_system_user
from tests.harness.hub import Hub, merged

CLAIM_PROFILE = "gpu-quarter"
STAMPEDE_PROFILE = "gpu-eighth"
STAMPEDE_USERS = 20
STAMPEDE_POOL = 10
STAMPEDE_SECONDS = 5.0

WARM_OVERLAY = merged(
    GPULAB_OVERLAY,
    Config(
        GPUWarmPool={
            "pools": [
                {"profile": CLAIM_PROFILE, "min": 1, "max": 1},
                {"profile": STAMPEDE_PROFILE, "min": STAMPEDE_POOL, "max": STAMPEDE_POOL},
            ],
            "check_interval_seconds": 0.5,
        }
    ),
)


def wait_pool(hub: Hub, profile: str, count: int, timeout: float = 300) -> float:
    """Seconds until `count` members of `profile` are ready."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if hub.capacity()[profile]["ready_now"] >= count:
            return time.perf_counter() - t0
        time.sleep(0.1)
    raise TimeoutError(f"{count} warm {profile} members not ready in {timeout} s")


def log_since(hub: Hub, since: int) -> str:
    """The hub's log from byte `since` on."""
    return hub.log_path.read_bytes()[since:].decode(errors="replace")


def served_warm(log: str, allocation_id: str) -> bool:
    """Whether `log` says the start of `allocation_id` ('alice/', 'alice/gpu-quarter') took a
    pool member (the local spawner's line for a warm start)."""
    return any(
        f"GPU allocation {allocation_id} (profile" in line and "served warm by" in line
        for line in log.splitlines()
    )


def stampede(hub: Hub) -> dict[str, Any]:
    users = [f"s{i:02d}" for i in range(STAMPEDE_USERS)]
    for user in users:
        hub.create_user(user)
        # returning users (untimed): their accounts exist, as after a first login; a new user's
        # account is made at her first start (useradd, about 1.5 s here, one at a time)
        timed_spawn(hub, user, "cpu")
    results: dict[str, tuple[float, bool]] = {}
    since = hub.log_path.stat().st_size

    def login(user: str) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            r = hub.spawn(user, profile=STAMPEDE_PROFILE)
            if r.status_code in (201, 202):
                hub.wait_ready(user, timeout=240)
                ok = True
        except Exception:  # counted as a failure
            ok = False
        results[user] = (time.perf_counter() - t0, ok)

    threads = []
    gap = STAMPEDE_SECONDS / STAMPEDE_USERS
    for user in users:
        thread = threading.Thread(target=login, args=(user,))
        thread.start()
        threads.append(thread)
        time.sleep(gap)
    for thread in threads:
        thread.join()
    log = log_since(hub, since)
    warm_users = {u for u in users if served_warm(log, f"{u}/")}
    refill = wait_pool(hub, STAMPEDE_PROFILE, STAMPEDE_POOL)
    for user in users:
        hub.stop_server(user)
    return {
        "failures": sum(1 for _, ok in results.values() if not ok),
        "warm": [results[u][0] for u in users if u in warm_users and results[u][1]],
        "cold": [results[u][0] for u in users if u not in warm_users and results[u][1]],
        "refill_s": refill,
    }


def vscode_rounds(hub: Hub, rounds: int = 20) -> tuple[str, list[float], int]:
    """VS Code's request sequence (tests.harness.vscode), `rounds` times: connect, start the
    named server called like the pool's profile with an empty body (the named-server
    convention), run a cell that must see the share, stop. Each round waits (untimed) for the
    pool to have refilled. Returns 'k/rounds', each round's seconds and how many were warm."""
    import asyncio

    from tests.harness.vscode import make_ide_token, replay

    hub.create_user("vscode")
    token = make_ide_token(hub, "vscode")
    ok, seconds, warm = 0, [], 0
    for _ in range(rounds):
        wait_pool(hub, CLAIM_PROFILE, 1)
        since = hub.log_path.stat().st_size
        result = asyncio.run(replay(hub.url, "vscode", token, server_name=CLAIM_PROFILE))
        shared = result.ok and bool(result.env.get("CUDA_VISIBLE_DEVICES"))
        ok += shared
        seconds.append(result.seconds)
        warm += served_warm(log_since(hub, since), f"vscode/{CLAIM_PROFILE}")
    return f"{ok}/{rounds}", seconds, warm


KUBE_PROFILE = "a100-1"
STOCK_KUBE_PROFILE = "gpu-1"
STOCK_NAMESPACE = "bench-stock"


def kube_overlays() -> tuple[Config, Config]:
    """The stock KubeSpawner hub (one whole GPU by a profile_list entry's limits) and the gpulab hub
    with a one-member pool of a one-GPU profile, over bench.kube_spawn's common settings."""
    from bench.kube_spawn import COMMON

    stock = merged(
        COMMON,
        Config(
            {
                "JupyterHub": {"spawner_class": "kubespawner.KubeSpawner"},
                # named by a start's options (a start without any gets gpulab's default
                # profile from the hub's empty-start handling, which stock KubeSpawner refuses)
                "KubeSpawner": {
                    # a namespace of its own: gpulab's servers' NetworkPolicy (in default)
                    # would cut its pods off from their hub
                    "namespace": STOCK_NAMESPACE,
                    "profile_list": [
                        {
                            "display_name": "1 GPU",
                            "slug": STOCK_KUBE_PROFILE,
                            "default": True,
                            "kubespawner_override": {
                                "extra_resource_limits": {"nvidia.com/gpu": "1"},
                                "extra_resource_guarantees": {"nvidia.com/gpu": "1"},
                            },
                        }
                    ],
                },
            }
        ),
    )
    warm = merged(
        COMMON,
        Config(
            {
                "JupyterHub": {"spawner_class": "gpulab-kube"},
                "GPUCapacity": {
                    "profiles": [{"slug": KUBE_PROFILE, "gpus": 1, "default": True}],
                },
                "GPUWarmPool": {
                    "pools": [{"profile": KUBE_PROFILE, "min": 1, "max": 1}],
                    "check_interval_seconds": 0.5,
                },
            }
        ),
    )
    return stock, warm


def kube_warm(rounds: int) -> tuple[dict[str, list[float]], list[str]] | str:
    """Stock KubeSpawner vs GPUKubeSpawner warm claims on a private dev cluster: the spawn
    times and whether each warm spawn was served warm; or why it could not run."""
    from gpulab.devcluster import DevCluster, NodeSpec, ensure_binaries
    from tests.harness.kube import kube_hub_overlay

    try:
        ensure_binaries()
    except Exception as e:  # no Go toolchain, no network for the sources, ...
        return f"dev cluster binaries unavailable: {e}"
    stock_overlay, warm_overlay = kube_overlays()
    node = NodeSpec("bench-a100", gpus=8, cpu=256, memory_gib=2048)
    times: dict[str, list[float]] = {"stock": [], "warm": []}
    kinds: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-kubewarm-") as tmp:
        root = Path(tmp)
        cluster = DevCluster(root / "cluster", log=lambda msg: None)
        cluster.up(nodes=[node], timeout=240)
        env = {"KUBECONFIG": str(cluster.kubeconfig)}
        cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": STOCK_NAMESPACE}})
        wait_service_account(cluster, STOCK_NAMESPACE)
        stock = Hub(root / "stock", kube_hub_overlay(cluster, stock_overlay), env)
        warm = Hub(root / "warm", kube_hub_overlay(cluster, warm_overlay), env)
        hubs = {"stock": (stock, STOCK_KUBE_PROFILE), "warm": (warm, KUBE_PROFILE)}
        try:
            for hub, _ in hubs.values():
                hub.start()
                hub.create_user("bench")
            for name, (hub, profile) in hubs.items():  # untimed: caches, priority classes
                if name == "warm":
                    wait_pool(warm, KUBE_PROFILE, 1)
                timed_spawn(hub, "bench", profile)
            names = list(hubs)
            for i in range(rounds):
                order = names if i % 2 == 0 else names[::-1]
                for name in order:
                    hub, profile = hubs[name]
                    if name == "warm":
                        wait_pool(warm, KUBE_PROFILE, 1)  # a Running member pod
                        since = warm.log_path.stat().st_size
                    times[name].append(timed_spawn(hub, "bench", profile))
                    if name == "warm":
                        served = served_warm(log_since(warm, since), "bench/")
                        kinds.append("warm" if served else "cold")
        except Exception:
            for name, (hub, _) in hubs.items():  # the logs go with the temporary directory
                kept = Path(tempfile.gettempdir()) / f"gpulab-bench-kubewarm-{name}-hub.log"
                kept.write_text(hub.log())
                print(f"bench.warm: the {name} hub's log is kept in {kept}", file=sys.stderr)
            raise
        finally:
            for hub, _ in hubs.values():
                hub.close()
            # member pods outlive a hub (the next one sweeps them): the cluster goes with them
            cluster.down()
            for hub, _ in hubs.values():
                hub.cleanup()
    return times, kinds


def wait_service_account(cluster: Any, namespace: str, timeout: float = 60) -> None:
    """Until `namespace`'s default ServiceAccount has its token (its pods can start)."""
    import urllib.error

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            path = f"/api/v1/namespaces/{namespace}/serviceaccounts/default"
            # made by the service-account controller (pods get projected tokens)
            if cluster.api("GET", path).get("metadata", {}).get("name"):
                return
        except urllib.error.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"namespace {namespace}'s default ServiceAccount not ready")


def print_kube(result: tuple[dict[str, list[float]], list[str]] | str) -> str | None:
    """The dev cluster's table; kube_warm_ratio's value, or None when not measured (the reason
    is `result` then, which the last lines print)."""
    if isinstance(result, str):
        print(f"dev cluster: kube_warm_ratio=n/a ({result})")
        return None
    times, kinds = result
    labels = {
        "stock": "KubeSpawner (stock, 1 GPU)",
        "warm": f"GPUKubeSpawner warm claim ({KUBE_PROFILE})",
    }
    ratio = print_table(labels, times, "stock", "warm")
    print(f"dev cluster warm claims served warm: {kinds.count('warm')}/{len(kinds)}")
    return f"{ratio:.3f}"


def main(rounds: int, *, kube_only: bool = False) -> int:
    if kube_only:
        kube = kube_warm(rounds)
        print_last_lines({"kube_warm_ratio": print_kube(kube)}, _why_not_kube(kube))
        return 0
    stock_user = f"gpulab-bench-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-warm-") as tmp:
        root = Path(tmp)
        stock = Hub(root / "stock", STOCK_OVERLAY)
        cold = Hub(root / "cold", GPULAB_OVERLAY)
        warm = Hub(root / "warm", WARM_OVERLAY)
        _make_system_user(stock_user, stock.state_dir / "homes" / stock_user)
        hubs: dict[str, tuple[Hub, str | None, str]] = {
            "stock": (stock, None, stock_user),
            "cold": (cold, CLAIM_PROFILE, "bench"),
            "warm": (warm, CLAIM_PROFILE, "bench"),
        }
        times: dict[str, list[float]] = {name: [] for name in hubs}
        kinds: list[str] = []
        try:
            for hub, _, user in hubs.values():
                hub.start()
                hub.create_user(user)
            wait_pool(warm, STAMPEDE_PROFILE, STAMPEDE_POOL)
            for name, (hub, profile, user) in hubs.items():  # untimed: accounts, caches
                if name == "warm":
                    wait_pool(warm, CLAIM_PROFILE, 1)
                timed_spawn(hub, user, profile)
            names = list(hubs)
            for i in range(rounds):
                order = names[i % len(names) :] + names[: i % len(names)]
                for name in order:
                    hub, profile, user = hubs[name]
                    if name == "warm":
                        wait_pool(warm, CLAIM_PROFILE, 1)
                        since = warm.log_path.stat().st_size
                    times[name].append(timed_spawn(hub, user, profile))
                    if name == "warm":
                        served = served_warm(log_since(warm, since), f"{user}/")
                        kinds.append("warm" if served else "cold")
            rush = stampede(warm)
            vscode, vscode_seconds, vscode_warm = vscode_rounds(warm)
        finally:
            for hub, _, _ in hubs.values():
                hub.close()
            for hub, _, _ in hubs.values():
                hub.cleanup()
            subprocess.run(["userdel", stock_user], check=False)

    labels = {
        "stock": "LocalProcessSpawner (stock, system user)",
        "cold": "gpulab cold (per-user account, 1/4 GPU)",
        "warm": "gpulab warm pool claim (1/4 GPU)",
    }
    kube = kube_warm(rounds)
    print_table(labels, times, "stock", "cold")
    kube_ratio = print_kube(kube)
    warm_ratio = statistics.median(times["warm"]) / statistics.median(times["stock"])
    warm_p95 = percentile(times["warm"], 0.95)
    print(f"warm claims served warm: {kinds.count('warm')}/{len(kinds)}")
    print(
        f"stampede: {STAMPEDE_USERS} starts in {STAMPEDE_SECONDS:g} s, pool {STAMPEDE_POOL}: "
        f"{len(rush['warm'])} warm (p50 {_p50(rush['warm'])}), {len(rush['cold'])} cold "
        f"(p50 {_p50(rush['cold'])}), {rush['failures']} failed, pool refilled in "
        f"{rush['refill_s']:.1f} s"
    )
    print(
        f"VS Code sequence (connect, empty start of named server {CLAIM_PROFILE}, cell, stop): "
        f"{vscode} ok, {vscode_warm} served warm, p50 {_p50(vscode_seconds)} a round"
    )
    fields = {
        "warm_ratio": f"{warm_ratio:.3f}",
        "warm_p95_s": f"{warm_p95:.3f}",
        "kube_warm_ratio": kube_ratio,
        "stampede_failures": str(rush["failures"]),
        "vscode_ok": str(vscode),
    }
    print_last_lines(fields, _why_not_kube(kube))
    return 0


def _why_not_kube(result: tuple[dict[str, list[float]], list[str]] | str) -> dict[str, str]:
    return {"kube_warm_ratio": result} if isinstance(result, str) else {}


def _p50(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s" if values else "-"
