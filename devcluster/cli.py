"""`gpulab dev-cluster up|down|status|build|stop-node|start-node`: the dev cluster from a shell."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .build import BuildError, ensure_binaries
from .cluster import DevCluster
from .spec import NodeSpec, default_nodes
from .state import DevClusterError, Timing, default_state_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        default=None,
        help=f"where the cluster keeps its data, logs and kubeconfig (default {default_state_dir()}, "
        "or $GPULAB_DEV_CLUSTER_DIR)",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="build if needed, start the control plane and the node agent")
    up.add_argument(
        "--nodes",
        help="JSON file with a list of nodes (NodeSpec fields: name, gpus, gpu_product, ...); "
        "default: two A100 nodes, a MIG node and a spot H100 node",
    )
    up.add_argument(
        "--fast-failure",
        action="store_true",
        help="notice node failures in ~16 s and evict after 30 s more (tests) instead of 40 s / 300 s",
    )
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    sub.add_parser("down", help="stop everything the cluster started and remove its data")
    st = sub.add_parser("status", help="what runs, the API address and the kubeconfig path")
    st.add_argument("--json", action="store_true")
    sub.add_parser("build", help="only build (or find cached) the Kubernetes binaries")
    for name, what in (("stop-node", "simulate a failure of"), ("start-node", "bring back")):
        p = sub.add_parser(name, help=f"{what} one simulated node")
        p.add_argument("node")


def run(args: argparse.Namespace) -> int:
    timing = Timing.fast() if getattr(args, "fast_failure", False) else Timing()
    cluster = DevCluster(args.state_dir, timing=timing)
    try:
        if args.action == "build":
            for name, path in ensure_binaries().items():
                print(f"{name}: {path}")
        elif args.action == "up":
            nodes = default_nodes()
            if args.nodes:
                nodes = [NodeSpec.from_dict(d) for d in json.loads(Path(args.nodes).read_text())]
            cluster.up(nodes=nodes, timeout=args.timeout)
            _print_status(cluster.status())
        elif args.action == "down":
            stopped = cluster.down()
            print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        elif args.action == "status":
            status = cluster.status()
            if args.json:
                print(json.dumps(status, indent=2))
            else:
                _print_status(status)
            return 0 if status["up"] else 3
        elif args.action == "stop-node":
            cluster.stop_node(args.node)
            print(f"node {args.node}: heartbeats stopped, pod processes killed")
        elif args.action == "start-node":
            cluster.start_node(args.node)
            print(f"node {args.node}: running again")
    except (BuildError, DevClusterError) as e:
        print(f"gpulab dev-cluster: {e}", file=sys.stderr)
        return 1
    return 0


def _print_status(status: dict) -> None:
    some = any(p["running"] for p in status["processes"].values())
    state = "up" if status["up"] else ("partly running (up restarts it)" if some else "down")
    print(f"dev cluster: {state} (state {status['state_dir']})")
    if status["up"]:
        print(f"  API:        {status['api']}")
        print(f"  kubeconfig: {status['kubeconfig']}")
        print(f"  try:        KUBECONFIG={status['kubeconfig']} kubectl get nodes")
    for name, p in status["processes"].items():
        print(f"  {name:<24} pid {p['pid']:<8} {'running' if p['running'] else 'NOT running'}")
    nodes = status.get("nodes") or {}
    for name, n in nodes.items():
        if isinstance(n, dict):
            print(
                f"  node {name:<19} {'running' if n['running'] else 'stopped'}  {len(n['pods'])} pod(s)"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpulab.devcluster", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
