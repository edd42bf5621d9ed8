"""GPUKubeSpawner (entry point ``gpulab-kube``) and its Kubernetes pieces.

The spawner needs the ``kube`` extra (KubeSpawner, kubernetes_asyncio). It lives in
`gpulab.spawner.kube.spawner` and is re-exported here, lazily, so that
``gpulab.spawner.kube.GPUKubeSpawner`` keeps working in existing configs while the pure modules
of this package (manifests in `objects`, `gpu_resources`, `nodes`, `quantities`, `snapshots`)
import without KubeSpawner; `isolation`, `state` and `spawner` need the client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GPUKubeSpawner"]


def __getattr__(name: str) -> Any:
    if name == "GPUKubeSpawner":
        from gpulab.spawner.kube.spawner import GPUKubeSpawner

        return GPUKubeSpawner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
