"""Start a gpulab Dask scheduler: ``dask scheduler`` with its dashboard under a secret prefix.

`python -m gpulab.spawner.singleuser.dask_scheduler --scheduler-file F --host 127.0.0.1 ...` is
what the local Dask executor (``gpulab.spawner.local.dask``) starts as the cluster's owner.
The dashboard is served under a per-cluster prefix the hub's proxy alone knows; ``dask
scheduler`` takes it only as ``--dashboard-prefix``, but a process's argv is readable by every
account (/proc/<pid>/cmdline), so the prefix comes from the Dask config file the hub wrote 0600
for the owner (key ``gpulab.dashboard-prefix``, read through ``DASK_CONFIG``) and is handed to
the scheduler's command line parser in this process, never to exec.

Runs as the owner: it imports nothing of the hub's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

#: the Dask config key of the dashboard's prefix (a path segment, no slashes)
DASHBOARD_PREFIX_KEY = "gpulab.dashboard-prefix"


def scheduler_args(args: Sequence[str], prefix: str) -> list[str]:
    """The scheduler's arguments with the dashboard prefix (pure)."""
    if "--dashboard-prefix" in args:
        raise SystemExit("gpulab: the dashboard prefix comes from the Dask config, not argv")
    return [*args, "--dashboard-prefix", f"/{prefix}"] if prefix else list(args)


def main(argv: Sequence[str] | None = None) -> None:
    import dask.config
    from distributed.cli.dask_scheduler import main as dask_scheduler

    from gpulab.spawner.singleuser.dask_http import PRELOAD

    args = list(sys.argv[1:] if argv is None else argv)
    prefix = str(dask.config.get(DASHBOARD_PREFIX_KEY, "") or "").strip("/")
    # nothing outside the prefix answers: distributed's / and /sitemap.json would name it
    args += ["--preload", PRELOAD]
    dask_scheduler.main(args=scheduler_args(args, prefix), prog_name="dask scheduler")


if __name__ == "__main__":
    main()
