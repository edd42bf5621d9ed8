"""python -m gpulab.devcluster.agent --kubeconfig KC --state-dir DIR --nodes-file nodes.json"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

from ..pki import KubeletPKI
from ..spec import NodeSpec, default_nodes
from .agent import Agent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpulab-node-agent", description="gpulab's node agent (a kubelet for processes)"
    )
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--state-dir", required=True, help="pods' files, volumes and control.json")
    p.add_argument("--nodes-file", help="JSON list of NodeSpec dicts (default: the demo nodes)")
    p.add_argument("--heartbeat-seconds", type=float, default=10.0)
    p.add_argument(
        "--kubelet-pki",
        help="folder of the kubelet CA (pki.KubeletPKI); without it no node serves a kubelet API",
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    if args.nodes_file:
        nodes = [NodeSpec.from_dict(d) for d in json.loads(Path(args.nodes_file).read_text())]
    else:
        nodes = default_nodes()
    asyncio.run(
        Agent(
            args.kubeconfig,
            Path(args.state_dir).resolve(),
            nodes,
            args.heartbeat_seconds,
            kubelet_pki=KubeletPKI(Path(args.kubelet_pki)) if args.kubelet_pki else None,
        ).run()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
