"""Fill each sharing backend of a dev-cluster node through a spawner and count over-admission.

For MIG instances, time-slicing replicas and HAMi splits, `slots + 2` users spawn a server that
asks for one share (gpulab's one after another; the anchor's at once, since it queues nothing),
against a node whose devices hold `slots` of them. A spawner
over-admits when it accepts a spawn that no device can hold: the pod is created and stays
Pending until the start times out. gpulab's GPUKubeSpawner places against the node's devices
and refuses the extra spawns with a 409 before any pod exists; the anchor, stock KubeSpawner
with the same resources in `extra_resource_limits` (what a z2jh profile does), creates them all.
The two alternate per backend, against the same cluster.

    .venv/bin/python -m bench.kube_fill [--quick] [--extra N]

Last line: mig_overadmit=<n> timeslice_overadmit=<n> hami_overadmit=<n> pending_pods=<n>
(gpulab's figures; all 0 when every backend is filled exactly) and the anchor's beside them.
--quick fills the MIG backend only; the others' fields are n/a, the line before saying so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time
from pathlib import Path

from traitlets.config import Config

from bench._lastline import print_last_lines
from gpulab.devcluster import DevCluster, ensure_binaries
from tests.harness.hub import Hub, merged
from tests.harness.kube import KUBE_HUB_OVERLAY, SPAWNER_NODES, kube_hub_overlay
from tests.harness.kube_fill import BACKENDS, FillResult, backend_overlay, fill

#: what a stock KubeSpawner profile asks for, per backend (the 1/8 L40S share HAMi's way)
STOCK_LIMITS = {
    "mig": {"nvidia.com/mig-2g.20gb": "1"},
    "time-slicing": {"nvidia.com/gpu.shared": "1"},
    "hami": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "5758", "nvidia.com/gpucores": "13"},
}
STOCK_START_TIMEOUT = 90


def stock_overlay(sharing: str, node: str) -> Config:
    limits = STOCK_LIMITS[sharing]
    return merged(
        KUBE_HUB_OVERLAY,
        Config(
            {
                "JupyterHub": {"spawner_class": "kubespawner.KubeSpawner"},
                "KubeSpawner": {
                    "namespace": "default",
                    "image": "gpulab/singleuser:dev",
                    "start_timeout": STOCK_START_TIMEOUT,
                    "http_timeout": 90,
                    "delete_grace_period": 2,
                    "extra_resource_limits": limits,
                    "extra_resource_guarantees": limits,
                    "node_selector": {"kubernetes.io/hostname": node},
                },
            }
        ),
    )


def fill_stock(hub: Hub, cluster: DevCluster, sharing: str, slots: int, extra: int) -> FillResult:
    """The anchor: every spawn is accepted; count the servers that come up and the pods the
    scheduler leaves Pending (unschedulable) while they do."""
    result = FillResult(sharing, "extra_resource_limits", slots, slots + extra)
    users = [f"st{sharing.replace('-', '')[:4]}{i}" for i in range(slots + extra)]
    for user in users:
        hub.create_user(user)
    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        codes = list(pool.map(lambda u: hub.spawn(u).status_code, users))
    for user, code in zip(users, codes, strict=True):
        if code not in (201, 202):
            result.refused[user] = str(code)
    unschedulable: set[str] = set()
    deadline = time.monotonic() + STOCK_START_TIMEOUT - 10
    while time.monotonic() < deadline:
        for pod in placed_pods_any(cluster, users):
            conditions = (pod.get("status") or {}).get("conditions") or []
            if any(c.get("reason") == "Unschedulable" for c in conditions):
                unschedulable.add(pod["metadata"]["name"])
        ready = [u for u in users if (hub.server_model(u) or {}).get("ready")]
        if len(ready) >= slots and len(unschedulable) >= len(users) - len(ready):
            break
        time.sleep(1)
    result.pending_pods = sorted(unschedulable)
    # a spawn the hub accepted is admitted, whether its pod runs or waits
    result.started = [u for u in users if u not in result.refused]
    return result


def placed_pods_any(cluster: DevCluster, users: list[str]) -> list[dict]:
    pods = cluster.api("GET", "/api/v1/namespaces/default/pods")["items"]
    return [
        p
        for p in pods
        if (p["metadata"].get("annotations") or {}).get("hub.jupyter.org/username") in users
    ]


#: the sharing backend a --quick run fills (the others are the same path with other devices)
QUICK_BACKEND = "mig"
#: the last line's field of each backend's over-admission
OVERADMIT_FIELD = {
    "mig": "mig_overadmit",
    "time-slicing": "timeslice_overadmit",
    "hami": "hami_overadmit",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"fill the {QUICK_BACKEND} backend only"
    )
    parser.add_argument("--extra", type=int, default=2, help="spawns beyond the slots (default 2)")
    return parser.parse_args(argv)


def backends_of(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    return [b for b in BACKENDS if b[0] == QUICK_BACKEND] if args.quick else list(BACKENDS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_binaries()
    rows: list[tuple[str, FillResult]] = []
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-fill-") as tmp:
        root = Path(tmp)
        cluster = DevCluster(root / "cluster", log=lambda msg: None)
        cluster.up(nodes=SPAWNER_NODES, timeout=240)
        env = {"KUBECONFIG": str(cluster.kubeconfig)}
        try:
            for k, (sharing, profile, node, slots) in enumerate(backends_of(args)):
                order = ["gpulab", "stock"] if k % 2 == 0 else ["stock", "gpulab"]
                for who in order:  # alternate which spawner fills first
                    overlay = (
                        backend_overlay(sharing, cluster)
                        if who == "gpulab"
                        else kube_hub_overlay(cluster, stock_overlay(sharing, node))
                    )
                    hub = Hub(root / f"{who}-{sharing}", overlay, env)
                    try:
                        hub.start()
                        if who == "gpulab":
                            result = fill(hub, cluster, sharing, profile, slots, args.extra)
                        else:
                            result = fill_stock(hub, cluster, sharing, slots, args.extra)
                        rows.append((who, result))
                    finally:
                        hub.close()  # stops its servers: the next fill finds the node empty
        finally:
            cluster.down()

    head = ("backend", "spawner", "asked", "slots", "started", "409", "pending pods", "overadmit")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for who, r in rows:
        name = "GPUKubeSpawner" if who == "gpulab" else "KubeSpawner (stock)"
        cells = (r.sharing, name, r.asked, r.slots, len(r.started), len(r.refused))
        print(" | ".join(map(str, (*cells, len(r.pending_pods), r.overadmitted))))
    mine = {r.sharing: r for who, r in rows if who == "gpulab"}
    stock = {r.sharing: r for who, r in rows if who == "stock"}
    fields: dict[str, str | None] = {
        field: str(mine[sharing].overadmitted) if sharing in mine else None
        for sharing, field in OVERADMIT_FIELD.items()
    }
    fields["pending_pods"] = str(sum(len(r.pending_pods) for r in mine.values()))
    fields["stock_overadmit"] = str(sum(r.overadmitted for r in stock.values()))
    fields["stock_pending_pods"] = str(sum(len(r.pending_pods) for r in stock.values()))
    why_not = {
        field: f"--quick fills {QUICK_BACKEND} only"
        for sharing, field in OVERADMIT_FIELD.items()
        if sharing not in mine
    }
    print_last_lines(fields, why_not)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
