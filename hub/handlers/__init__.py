"""gpulab's hub pages (HTML) and its checks in front of JupyterHub's own server handlers.

`default_handlers`: the pages (`/hub/gpulab/workspaces`, Dask dashboards under `/hub/gpulab/dask/`,
the GPU admin panel `/hub/gpulab/admin` with its static files, the VS Code token page
`/hub/gpulab/ide`), registered by
`gpulab.hub.config.apply(c)` as extra handlers. `servers.server_handler_overrides` are not among
them: they must come before JupyterHub's own routes, so apply(c) has the authenticator return them.
"""

from __future__ import annotations

from typing import Any

from gpulab.hub.handlers import admin_panel, dask_dashboard, ide, workspaces

default_handlers: list[tuple[str, type[Any]]] = [
    *workspaces.default_handlers,
    *dask_dashboard.default_handlers,
    *admin_panel.default_handlers,
    *ide.default_handlers,
]
