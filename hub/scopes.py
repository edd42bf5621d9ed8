"""gpulab's custom scopes (JupyterHub's `custom:` scopes): what a role may grant beyond JupyterHub's own.

They are defined here, when this module is imported, because `needs_scope` checks at decoration
time that a scope exists: the REST handlers that use them import this module first.
`gpulab.hub.config.apply(c)` puts the same definitions into `c.JupyterHub.custom_scopes`, so
that roles in `c.JupyterHub.load_roles` may grant them (JupyterHub defines them again at start;
an identical definition is no conflict).
"""

from __future__ import annotations

from jupyterhub.scopes import define_custom_scopes

from gpulab.spawner.names import REPORT_GPU_SCOPE

#: list every user's GPU allocations (GET /hub/api/gpulab/allocations); admins may already
#: (admin:users): grant this to a service or a group that should read them and do nothing else
ALLOCATIONS_READ = "custom:gpulab:allocations:read"

#: manage one's Dask clusters (/hub/api/gpulab/users/{user}/dask-clusters, their dashboards):
#: granted as `custom:gpulab:dask!user` (each user, on herself) through the `user` role and every
#: server's token, so `gpulab.dask.GPUCluster` in a notebook needs nothing more. The `!user`
#: filter names the owner: it reaches no other tenant's clusters.
DASK = "custom:gpulab:dask"

#: the GPU admin panel (/hub/gpulab/admin) and what it reads: every server, job and Dask worker
#: with its GPU, live figures and idle times, every user's and group's GPU-hours and quota
#: (/hub/api/gpulab/admin/..., /hub/api/gpulab/usage). Reading only: each action below has its own.
#: Admins (admin:users) may too; grant this to a role of operators who should see, not administer.
ADMIN_READ = "custom:gpulab:admin-read"

#: preempt another user's preemptible workload from the admin panel (its share goes back to the
#: allocator; the owner is told). Stopping a server is JupyterHub's own `servers` scope.
PREEMPT = "custom:gpulab:preempt"

#: a user's own GPU-hours and remaining GPU-hour budget (/hub/api/gpulab/users/{user}/usage):
#: granted as `custom:gpulab:usage!user` through the `user` role and every server's token; the
#: `!user` filter names the owner, so it reads no other tenant's figures.
USAGE = "custom:gpulab:usage"

#: report the GPU figures of one's own job run or Dask worker to gpulab-metrics. Granted as
#: `custom:gpulab:report-gpu!user` through the `user` role only so that the hub may issue each
#: workload a token of its owner narrowed to that one workload (`!server=<owner>/job-17`):
#: JupyterHub gives a token no scope its owner lacks. It reads nothing and reaches no server.
REPORT_GPU = REPORT_GPU_SCOPE

#: every custom scope gpulab defines, as `c.JupyterHub.custom_scopes` takes them
CUSTOM_SCOPES: dict[str, dict[str, str]] = {
    ALLOCATIONS_READ: {
        "description": "List every user's GPU allocations (which GPUs, on which node, why).",
    },
    DASK: {
        "description": "Create, scale, stop and connect to Dask clusters, and open their "
        "dashboards.",
    },
    ADMIN_READ: {
        "description": "Open the GPU admin panel: every workload's GPU, utilisation and idle "
        "time, every user's and group's GPU-hours and quotas.",
    },
    PREEMPT: {
        "description": "Preempt a preemptible (spot) workload of another user.",
    },
    USAGE: {
        "description": "Read GPU-hours used and the GPU-hour budget left.",
    },
    REPORT_GPU: {
        "description": "Report the GPU utilisation and memory of one's own job runs and Dask "
        "workers to gpulab-metrics.",
    },
}

define_custom_scopes(CUSTOM_SCOPES)
