"""gpulab's JupyterLab extension: GPU panels in the lab, served by a small server extension."""

from __future__ import annotations

import logging
from typing import Any

from ._version import __version__

__all__ = ["__version__"]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "jupyterlab-gpulab"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "jupyterlab_gpulab"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the gpulab/monitor routes; sampling starts once the server's loop runs."""
    from .handlers import setup_handlers
    from .monitor import GPUMonitor

    # the package's module loggers write where the server's log goes
    pkg_log = logging.getLogger(__name__)
    pkg_log.propagate = False
    pkg_log.setLevel(server_app.log.level)
    for handler in server_app.log.handlers:
        pkg_log.addHandler(handler)

    monitor = GPUMonitor(parent=server_app)
    setup_handlers(server_app.web_app, monitor)
    server_app.log.info(
        "jupyterlab_gpulab %s: GPU monitor (%s source) at %sgpulab/monitor/",
        __version__,
        monitor.device_source.kind,
        server_app.base_url,
    )


async def _start_jupyter_server_extension(server_app: Any) -> None:
    server_app.web_app.settings["gpulab_monitor"].start()
