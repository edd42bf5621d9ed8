"""The dev cluster (real control plane + gpulab's node agent) as a test fixture body."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from gpulab.devcluster import DevCluster, NodeSpec, Timing, ensure_binaries
from tests.harness.tiers import note_started


@contextlib.contextmanager
def running_dev_cluster(state_dir: Path, nodes: Sequence[NodeSpec]) -> Iterator[DevCluster]:
    """A cluster with `nodes` and fast node-failure timing, stopped (all processes) on exit."""
    note_started("kube")
    ensure_binaries()  # a cold build takes ~10 min on 2 cores; later sessions use the cache
    cluster = DevCluster(state_dir, timing=Timing.fast())
    try:
        cluster.up(nodes=list(nodes), timeout=240)
        yield cluster
    finally:
        cluster.down()
