"""gpulab.dask: Dask GPU clusters owned by the hub, from any notebook (decision record 0003).

    from gpulab.dask import GPUCluster, list_clusters
    cluster = GPUCluster(profile="1/4 GPU", n_workers=4)
    client = cluster.get_client()

The folder lives with the user-side code (spawner/singleuser/) and is mapped to the import name
``gpulab.dask`` (pyproject's package-dir): a top-level ``dask/`` folder would shadow the real
``dask`` package on pytest's path.
"""

from .cluster import GPUCluster, HubAdaptive, list_clusters, security_loader
from .hubapi import (
    ClusterInfo,
    DaskClusterNotFound,
    DaskNameTaken,
    DaskQuotaError,
    HubDask,
    HubDaskError,
    HubUnavailable,
    WorkerInfo,
)

__all__ = [
    "ClusterInfo",
    "DaskClusterNotFound",
    "DaskNameTaken",
    "DaskQuotaError",
    "GPUCluster",
    "HubAdaptive",
    "HubDask",
    "HubDaskError",
    "HubUnavailable",
    "WorkerInfo",
    "list_clusters",
    "security_loader",
]
