"""TensorBoard for the owner's job runs, served by jupyter-server-proxy at <base_url>tensorboard/.

One TensorBoard per server, started on the first request, reading every run's output directory
below `~/gpulab-jobs` (a run's event files in `<job>/run-<id>/...` show as the run
`<job>/run-<id>/...`); the jobs panel opens it with TensorBoard's own `runFilter` set to one run.
It sits behind the server's own authentication, so the hub's login (its cookie) lets its owner in
and nobody else, and no token is ever in the URL. It listens on 127.0.0.1 only. `%tensorboard`
in a notebook keeps working through the same proxy: the server extension sets
`TENSORBOARD_PROXY_URL` (`<base_url>proxy/%PORT%/`) for its kernels.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: below the owner's home: where the hub's jobs write their runs by default
RUNS_ROOT = "gpulab-jobs"
#: TensorBoard loads its plugins for a while before it answers (seconds)
START_TIMEOUT_SECONDS = 90


def runs_root(home: str | None = None) -> str:
    return os.path.join(home or os.path.expanduser("~"), RUNS_ROOT)


def _command(port: int, base_url: str) -> list[str]:
    root = runs_root()
    os.makedirs(root, exist_ok=True)  # TensorBoard refuses a logdir that is not there
    return [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        root,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--path_prefix",
        f"{base_url.rstrip('/')}/tensorboard",
        "--reload_interval",
        "5",
    ]


def server_process() -> dict[str, Any]:
    """jupyter-server-proxy's entry (`jupyter_serverproxy_servers` in pyproject.toml)."""
    return {
        "command": _command,
        "absolute_url": True,  # TensorBoard serves under its --path_prefix, the full path
        "timeout": START_TIMEOUT_SECONDS,
        "new_browser_tab": True,
        "launcher_entry": {"enabled": True, "title": "TensorBoard (job runs)"},
    }
