"""The embedded default's spawners: servers as local processes, one system account per user.

`GPUSimpleLocalSpawner` (entry point ``gpulab-simple``) and `GPULocalSpawner` (``gpulab-local``)
live in `gpulab.spawner.local.spawner`; this package re-exports them so that
``gpulab.spawner.local.GPUSimpleLocalSpawner`` keeps working in existing configs.
"""

from gpulab.spawner.local.spawner import (
    GPULocalSpawner,
    GPULocalSpawnerMixin,
    GPUSimpleLocalSpawner,
    shared_account_warning,
)

__all__ = [
    "GPULocalSpawner",
    "GPULocalSpawnerMixin",
    "GPUSimpleLocalSpawner",
    "shared_account_warning",
]
