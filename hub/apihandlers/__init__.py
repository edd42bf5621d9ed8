"""gpulab's REST endpoints under /hub/api/gpulab/, one module per resource (as
`jupyterhub.apihandlers`): capacity, allocations, workspace snapshots (with restore and clone)
GPU jobs, Dask clusters, GPU-hours, the GPU admin panel's overview, bulk actions and GPU-hour
budgets, and GPU-aware culling (servers' activity reports, "Switch to CPU", the admin's view of
decisions).

`default_handlers` is every route, relative to the hub's prefix; `gpulab.hub.config.apply(c)`
registers them (with the pages of `gpulab.hub.handlers`) as `c.JupyterHub.extra_handlers`.
"""

from __future__ import annotations

from typing import Any

from gpulab.hub.apihandlers import (
    admin,
    allocations,
    budgets,
    capacity,
    culling,
    dask,
    jobs,
    snapshots,
    usage,
)

default_handlers: list[tuple[str, type[Any]]] = [
    *capacity.default_handlers,
    *allocations.default_handlers,
    *snapshots.default_handlers,
    *jobs.default_handlers,
    *dask.default_handlers,
    *usage.default_handlers,
    *admin.default_handlers,
    *budgets.default_handlers,
    *culling.default_handlers,
]
