"""What the tests of a Dask cluster's Kubernetes manifests share: one owner's settings, her
quarter-A100 profile, a worker's placement, and the worker group built for it through
`placed_pod`, as the executor builds them.

Apart from the tests (tests/spawner/kube/test_dask_objects.py, test_dask_secrets.py,
test_dask_network.py) so that the three compare their manifests against the same cluster.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from gpulab.hub.allocator import GPU, GpuShare, Placement, Request
from gpulab.hub.profiles import Profile
from gpulab.spawner.kube.dask_objects import dask_worker_group_manifest
from gpulab.spawner.kube.dask_settings import KubeDaskSettings
from gpulab.spawner.kube.gpu_resources import placed_pod

A100 = "A100-SXM4-80GB"
CREATED = 1767225600.0
SETTINGS = KubeDaskSettings(
    namespace="gpulab-alice",
    image="quay.io/jupyter/pytorch-notebook:cuda12-2025-12-01",
    python="/opt/conda/bin/python",
    hub_cidrs=("10.0.0.5/32",),
)
QUARTER = Profile(
    "a100-quarter", "1/4 A100", Fraction(1, 4), frozenset({A100}), cpu_limit=2, mem_limit_mib=8192
)
LABELS = {
    "component": "gpulab-dask",
    "hub.jupyter.org/username": "alice",
    "gpulab.io/dask-cluster": "7",
}


def worker_placement(gpus: tuple[GpuShare, ...], node: str = "gpu-node-1") -> Placement:
    request = Request(
        id="alice/dask-7-w3",
        owner="alice",
        cpu_milli=2000,
        memory_mib=8192,
        gpu_milli=QUARTER.gpu_milli,
        gpu_models=QUARTER.gpu_models,
    )
    return Placement(request=request, node=node, gpus=gpus, created_at=CREATED)


def worker_group(
    sharing: str, device: GPU, share: GpuShare, report_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    placement = worker_placement((share,))
    pod = placed_pod(
        QUARTER,
        placement,
        sharing=sharing,
        priority="on-demand",
        device=device,
        gpu_memory_mib=device.memory_mib,  # as GPUKubeSpawner._gpu_memory_mib: the device's
    )
    return dask_worker_group_manifest(
        "alice",
        7,
        3,
        placement=placement,
        pod=pod,
        scheduler_address="tls://10.96.0.20:8786",
        cpu_milli=2000,
        memory_mib=8192,
        environment={"OMP_NUM_THREADS": "2"},
        settings=SETTINGS,
        report_keys=report_keys,
    )
