"""bench.jobs, phase 5: a node lost under a running job on the dev cluster (see bench.jobs).

Its own module: it needs the dev cluster (built once into ~/.cache/gpulab) and the Kubernetes
backend, which the other phases never touch.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from bench.jobs_common import (
    CHECKPOINTING_SCRIPT,
    TERMINAL,
    USER,
    BenchError,
    Gpulab,
    Results,
)
from tests.harness.hub import BIN, Hub, merged


def node_loss_unavailable() -> str | None:
    """Why the node-loss phase cannot run here (None: it can)."""
    from gpulab.hub.jobservice.executor import RunsJobs
    from gpulab.spawner.kube.spawner import GPUKubeSpawner

    if not isinstance(GPUKubeSpawner, RunsJobs):
        return "the Kubernetes backend runs no jobs yet (GPUKubeSpawner.job_executor)"
    return None


NODE_LOSS_NODES = ("bench-loss-a", "bench-loss-b")
NODE_LOSS_PROFILE = "a100-1"  # whole GPUs: the nodes have no MIG devices
NODE_LOSS_STEPS = 150


def _node_ready(cluster: Any, node: str) -> bool:
    conditions = cluster.api("GET", f"/api/v1/nodes/{node}")["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _node_loss_phase(cluster: Any, hub: Hub, *, finish: bool = True) -> float:
    """Seconds from the node under a running checkpointing job turning NotReady to the run
    printing, in a new attempt on another node, that it resumed from its checkpoint.

    `cluster`: a running `gpulab.devcluster.DevCluster` with the nodes NODE_LOSS_NODES; `hub`: a
    started hub with GPUKubeSpawner on it (`tests.harness.kube.kube_hub_overlay`). Everything
    goes through the REST API with the user's token, the input file through her server's
    contents API (where her pods see it), the failure through `gpulab dev-cluster stop-node`.
    `finish`: wait for the resumed run to succeed (else cancel it once it resumed: `--quick`)."""
    hub.create_user(USER)
    hub.start_server(USER, profile="cpu")
    side = Gpulab(hub)
    contents = httpx.Client(
        base_url=f"{hub.url}/user/{USER}/api/contents",
        headers=side.client.headers,
        timeout=60,
    )
    r = contents.put(
        "/checkpointing.py",
        json={"type": "file", "format": "text", "content": CHECKPOINTING_SCRIPT},
    )
    if r.status_code not in (200, 201):
        raise BenchError(f"writing the job's script through her server: {r.status_code} {r.text}")
    # her server is gone before the job starts: a ReadWriteOnce home mounted by a running server
    # on one node refuses a job on another (`spawner/kube/jobs.py`), and the run must move
    hub.stop_server(USER)
    run_id, _ = side.submit(
        {
            "name": "node-loss",
            "kind": "script",
            "path": "checkpointing.py",
            "args": [str(NODE_LOSS_STEPS)],
            "profile": NODE_LOSS_PROFILE,
            "max_retries": 3,
        }
    )
    run = side.wait(run_id, ("running", *TERMINAL), timeout=300)
    if run["state"] != "running":
        raise BenchError(f"node-loss run {run_id}: {run['state']} {run['reason']}")
    deadline = time.monotonic() + 120
    while "step 5\n" not in side.log(run_id):  # a few checkpoints written
        if time.monotonic() > deadline:
            raise BenchError(f"node-loss run {run_id} wrote no checkpoint in 120 s")
        time.sleep(0.5)
    node = side.run(run_id)["attempts"][-1]["node"]
    subprocess.run(
        [
            str(BIN / "gpulab"),
            "dev-cluster",
            "--state-dir",
            str(cluster.state_dir),
            "stop-node",
            node,
        ],
        check=True,
    )
    try:
        deadline = time.monotonic() + 300
        while _node_ready(cluster, node):
            if time.monotonic() > deadline:
                raise BenchError(f"node {node} still Ready 300 s after stop-node")
            time.sleep(0.2)
        not_ready = time.monotonic()
        ended_since: float | None = None  # a failed attempt's run is queued again right after
        while True:
            run = side.run(run_id)
            attempt = run["attempts"][-1]
            if attempt["node"] != node and attempt["state"] == "running":
                log = side.log(run_id, attempt=attempt["number"])
                if "resumed from step" in log:
                    resumed = time.monotonic() - not_ready
                    break
            ended_since = (ended_since or time.monotonic()) if run["state"] in TERMINAL else None
            now = time.monotonic()
            if (ended_since and now - ended_since > 15) or now - not_ready > 600:
                raise BenchError(f"node-loss run {run_id} did not resume on another node: {run}")
            time.sleep(0.2)
        if finish:
            side.wait(run_id, ("succeeded",), timeout=NODE_LOSS_STEPS * 2 + 120, poll=1)
        else:
            side.call("DELETE", f"{side.jobs}/{run_id}")
        return resumed
    finally:
        cluster.start_node(node)


def node_loss(root: Path, out: Results, skip: str | None, *, finish: bool = True) -> None:
    """The node-loss phase into `out` (its seconds, or why it was not measured)."""
    why = skip or node_loss_unavailable()
    if why is not None:
        out.node_loss_note = f"not measured: {why}"
        return
    from gpulab.devcluster import NodeSpec, ensure_binaries
    from tests.harness.cluster import running_dev_cluster
    from tests.harness.kube import KUBE_HUB_OVERLAY, kube_hub_overlay

    try:
        ensure_binaries()  # built once into ~/.cache/gpulab (minutes, cold)
    except Exception as e:
        out.node_loss_note = f"not measured: dev cluster binaries unavailable: {e}"[:300]
        return

    nodes = [NodeSpec(name, gpus=2, zone="zone-a") for name in NODE_LOSS_NODES]
    with running_dev_cluster(root / "cluster", nodes) as cluster:
        # the shipped node_failure_seconds (30 s), not the tests' 2 s: what an install gets
        overlay = kube_hub_overlay(
            cluster,
            merged(KUBE_HUB_OVERLAY, Config(GPUKubeSpawner={"node_failure_seconds": 30})),
        )
        hub = Hub(root / "kube-hub", overlay, env=cluster.env())
        try:
            hub.start()
            out.node_loss_s = _node_loss_phase(cluster, hub, finish=finish)
            out.node_loss_note = f"node of {NODE_LOSS_NODES} stopped under a checkpointing run"
        finally:
            hub.close()
            hub.cleanup()
