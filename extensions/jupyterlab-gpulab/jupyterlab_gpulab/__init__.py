"""gpulab's JupyterLab extension: GPU panels in the lab, served by a small server extension."""

from __future__ import annotations

import logging
import os
from typing import Any

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "jupyterlab-gpulab"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "jupyterlab_gpulab"}]


#: jupyter-scheduler's backend in every server with this extension: GPU jobs go to the hub's job
#: service (`scheduler.py`). A default only: a `SchedulerApp.scheduler_class` or
#: `environment_manager_class` in the server's own config wins.
SCHEDULER_DEFAULTS = {
    "scheduler_class": "jupyterlab_gpulab.scheduler.GPULabScheduler",
    "environment_manager_class": "jupyterlab_gpulab.scheduler.GPUProfileEnvironments",
}


def _link_jupyter_server_extension(server_app: Any) -> None:
    """Make gpulab's backend jupyter-scheduler's default. Every extension is linked before any
    is loaded, and jupyter-scheduler makes its scheduler when loaded, so this comes in time
    whatever the order. (Config in a `jupyter_server_config.d/*.json` file cannot do it: Jupyter
    Server reads only `jpserver_extensions` from those.) Under a hub, kernel websockets also take
    the token in the URL (`websocket_auth`: VS Code's remote kernels)."""
    if os.environ.get("JUPYTERHUB_API_URL") is not None:
        from . import websocket_auth

        websocket_auth.install(server_app)
    scheduler = server_app.extension_manager.extension_apps.get("jupyter_scheduler")
    if not scheduler or os.environ.get("JUPYTERHUB_API_URL") is None:
        return  # outside a hub, jupyter-scheduler keeps its stock local execution
    configured = server_app.config.get("SchedulerApp", {})
    for app in scheduler:
        for name, value in SCHEDULER_DEFAULTS.items():
            if name not in configured:
                setattr(app, name, value)


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the gpulab/monitor routes; sampling starts once the server's loop runs."""
    # imported here, not at the top: Dask workers import this package for its share-aware
    # preload (dask_preload) in images that may have no Jupyter server
    from jupyter_server.utils import url_path_join

    from .budget import setup_budget_handlers
    from .culling import setup_culling
    from .handlers import setup_handlers
    from .jobs_handlers import setup_job_handlers
    from .monitor import GPUMonitor
    from .vscode import count_only_input

    # the package's module loggers write where the server's log goes
    pkg_log = logging.getLogger(__name__)
    pkg_log.propagate = False
    pkg_log.setLevel(server_app.log.level)
    for handler in server_app.log.handlers:
        pkg_log.addHandler(handler)

    if os.environ.get("JUPYTERHUB_API_URL") is not None:
        from . import websocket_auth

        if websocket_auth.verify(server_app):
            server_app.log.info("jupyterlab_gpulab: kernel websockets take the token in the URL")
    monitor = GPUMonitor(parent=server_app)
    setup_handlers(server_app.web_app, monitor)
    setup_job_handlers(server_app.web_app)
    setup_budget_handlers(server_app.web_app)
    # GPU-aware culling: real input and busy kernels reported to the hub, its warnings shown
    setup_culling(server_app.web_app, server_app.kernel_manager)
    # VS Code in the browser (jupyter-server-proxy's route, loaded before this extension): only
    # the workbench's real input counts as activity, not its keep-alives
    if count_only_input(server_app.web_app):
        server_app.log.info("jupyterlab_gpulab: VS Code at %svscode/", server_app.base_url)
    try:  # Dask clusters in the lab: gpulab[dask] installs distributed and dask-labextension
        from .dask_lab import setup_dask_lab
    except ImportError as e:
        server_app.log.info("jupyterlab_gpulab: no Dask sidebar integration (%s)", e)
    else:
        server_app.web_app.settings["gpulab_dask_manager"] = setup_dask_lab(server_app)
    # `%tensorboard` in this server's kernels: its page through jupyter-server-proxy, behind this
    # server's auth, instead of a localhost port the browser cannot reach (kernels inherit this)
    os.environ.setdefault(
        "TENSORBOARD_PROXY_URL", url_path_join(server_app.base_url, "proxy/%PORT%/")
    )
    server_app.log.info(
        "jupyterlab_gpulab %s: GPU monitor (%s source) at %sgpulab/monitor/",
        __version__,
        monitor.device_source.kind,
        server_app.base_url,
    )


async def _start_jupyter_server_extension(server_app: Any) -> None:
    server_app.web_app.settings["gpulab_monitor"].start()
    server_app.web_app.settings["gpulab_culling"].start()
    manager = server_app.web_app.settings.get("gpulab_dask_manager")
    if manager is not None:
        from .dask_lab import start_dask_lab

        await start_dask_lab(server_app, manager)
