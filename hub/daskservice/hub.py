"""The cluster service inside a running hub: its options (`GPUDask`), its store, its executor from
the hub's spawner class, its start once the hub has started, and the server-stop hook.

`gpulab.hub.config.GPULabHubHooks` calls `GPUDask.instance(...).attach_to_hub(app)` while the hub
initialises, as it does for `GPUJobs`: the store opens at once (so that the hub's reconciliation
of GPU allocations, at the first spawn, keeps the shares clusters hold), and the service starts
after the hub has (users, spawners, proxy): recovery of the clusters that ran through a restart,
then admission. The REST handlers and the dashboard proxy reach it through
`GPUDask.instance().service`; `server_stopped` is every spawner's `post_stop_hook`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Integer, Unicode
from traitlets.config import SingletonConfigurable

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.dask import (
    MAX_IDLE_TIMEOUT_SECONDS,
    MIN_IDLE_TIMEOUT_SECONDS,
    Cluster,
    ClusterStore,
)
from gpulab.hub.hub_service import hub_started, wait_started
from gpulab.hub.report_tokens import ReportTokens

from .executor import ClusterTLS, RunsDaskClusters
from .service import DaskService

#: the clusters' folder the executors keep inside `GPUDask.state_dir` (logs, TLS files, records)
CLUSTERS_DIR = "dask-clusters"


class GPUDask(SingletonConfigurable):
    """Dask GPU clusters owned by the hub: schedulers and workers admitted by the same allocator
    and quotas as servers (see gpulab.hub.daskservice)."""

    enabled = Bool(
        True,
        config=True,
        help="""Run Dask clusters for users (/hub/api/gpulab/users/{user}/dask-clusters). Needs a
        spawner class whose backend runs clusters (gpulab's local spawner; Kubernetes with
        gpulab[kube]); with another one the API answers 501.""",
    )
    db_url = Unicode(
        "sqlite:///gpulab-dask.sqlite",
        config=True,
        help="""Where clusters, workers and their handles are kept, in SQLAlchemy's URL style:
        'sqlite:///path' (relative to the hub's working directory; the embedded default) or
        'postgresql://user@host/db' for cluster installs (needs gpulab[postgres]); clusters
        outlive hub restarts.""",
    )
    state_dir = Unicode(
        ".",
        config=True,
        help="""The hub's folder the executor keeps clusters' files in, in its 'dask-clusters'
        folder (relative to the hub's working directory: its state directory). That folder is
        made 0711: owners pass through it to their own clusters' folders, and list nothing.""",
    )
    default_idle_timeout_seconds = Integer(
        3600,
        config=True,
        help="""Stop a running cluster after this many seconds without tasks and without a
        client connected, when its spec names no idle timeout (kept-alive clusters too: a
        forgotten cluster must not hold GPUs for good).""",
    )
    max_idle_timeout_seconds = Integer(
        24 * 3600,
        config=True,
        help="""The longest idle timeout a cluster may have, whatever its spec asks (an admin's
        cap on how long idle GPUs may be held). Lowering it applies to running clusters too.""",
    )
    scheduler_cpu = Float(
        1.0,
        config=True,
        help="""CPU cores the allocator reserves for each cluster's scheduler (it runs no GPU
        code and counts against no GPU quota).""",
    )
    scheduler_memory_mib = Integer(
        1024,
        config=True,
        help="Memory (MiB) the allocator reserves for each cluster's scheduler.",
    )
    admission_interval_seconds = Float(
        5.0,
        config=True,
        help="""How often pending schedulers and workers are tried again without being woken (a
        new cluster, a scale, or any GPU share given back wakes admission at once).""",
    )
    monitor_interval_seconds = Float(
        2.0,
        config=True,
        help="""How often the hub asks each running cluster's scheduler which workers joined,
        whether it is idle and, for adaptive clusters, how many workers it wants.""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store: ClusterStore | None = None
        self.service: DaskService | None = None
        #: why the service does not run (None: it runs or is starting)
        self.unavailable: str | None = None
        self._starting: asyncio.Task[None] | None = None

    def attach_to_hub(self, app: Any) -> None:
        """Open the store now, start the service once the hub has started (module docstring).
        Called while the hub initialises, in its event loop."""
        if not self.enabled:
            self.unavailable = "Dask clusters are switched off on this hub (GPUDask.enabled)"
            return
        if not isinstance(app.spawner_class, RunsDaskClusters):
            self.unavailable = f"{app.spawner_class.__name__} runs no Dask clusters"
            return
        self.store = ClusterStore(self.db_url)
        capacity = GPUCapacity.instance(config=self.config, log=self.log)
        store = self.store
        capacity.keep_allocations(store.live_allocation_ids)
        self._starting = asyncio.ensure_future(self._start_after_hub(app, capacity))

    async def wait_started(self, timeout: float) -> None:
        """Return once the service has started (or could not), or after `timeout` s."""
        await wait_started(self._starting, timeout)

    async def _start_after_hub(self, app: Any, capacity: GPUCapacity) -> None:
        await hub_started(app)
        state = await asyncio.to_thread(_clusters_parent, Path(self.state_dir))

        async def spawner_for(owner: str) -> Any:
            return app.users[owner].spawner

        def affinity_group_of(cluster: Cluster) -> str | None:
            # the notebook's: workers share its rack where the allocator can
            user = app.users.get(cluster.owner)
            spawner = user.spawners.get(cluster.spec.server) if user is not None else None
            group = getattr(spawner, "gpulab_affinity_group", None)
            return str(group) if group else None

        def notebook_of(cluster: Cluster) -> str | None:
            # the allocation of the server the cluster came from: its workers go next to it
            user = app.users.get(cluster.owner)
            spawner = user.spawners.get(cluster.spec.server) if user is not None else None
            allocation = getattr(spawner, "allocation_id", None)
            return str(allocation) if allocation else None

        assert self.store is not None
        try:
            executor = app.spawner_class.dask_executor(
                state_dir=str(state), gpu_of=capacity.gpu_by_uuid, spawner_for=spawner_for
            )
            max_idle = max(
                MIN_IDLE_TIMEOUT_SECONDS,
                min(self.max_idle_timeout_seconds, MAX_IDLE_TIMEOUT_SECONDS),
            )
            reports = ReportTokens.of(app)
            service = DaskService(
                self.store,
                capacity,
                executor,
                make_tls=_make_tls,
                admission_interval_seconds=self.admission_interval_seconds,
                monitor_interval_seconds=self.monitor_interval_seconds,
                default_idle_timeout_seconds=min(self.default_idle_timeout_seconds, max_idle),
                max_idle_timeout_seconds=max_idle,
                scheduler_cpu_milli=int(self.scheduler_cpu * 1000),
                scheduler_memory_mib=self.scheduler_memory_mib,
                affinity_group_of=affinity_group_of,
                notebook_of=notebook_of,
                report_for=reports.issue,
            )
            await capacity.ready()
            await service.start()
            reports.sweep()  # after recovery: workers that ended while the hub was away
        except Exception as e:
            self.log.exception("gpulab: Dask clusters could not start")
            self.unavailable = f"Dask clusters could not start: {e}"
            return
        self.service = service
        self.log.info("gpulab: Dask clusters running (store %s)", self.db_url.split("@")[-1])

    async def server_stopped(self, owner: str, server: str) -> None:
        """A server of `owner` stopped: its clusters not kept alive stop, in the background (the
        server's stop does not wait for them)."""
        await self.wait_started(timeout=30)
        if self.service is not None:
            await self.service.server_stopped(owner, server)


def _make_tls(cluster: Cluster) -> ClusterTLS:
    from .tls import make_cluster_tls

    return make_cluster_tls(f"dask-{cluster.owner}-{cluster.id}"[:64])


#: the post-stop hooks' notices under way (a task with no reference may be collected mid-run)
_NOTICES: set[asyncio.Future[None]] = set()


async def post_stop_hook(spawner: Any) -> None:
    """`Spawner.post_stop_hook`: tell the cluster service that this server stopped (JupyterHub
    runs it after every stop: by its owner, the culler, an admin, or a server found dead).

    Returns at once, the notice going on in the background: JupyterHub counts a server as
    stopping until its hook returns, and a stopping server's record cannot be forgotten or its
    next start begun (its clusters' stops never waited for the server's anyway)."""
    dask = GPUDask.instance(config=spawner.config, log=spawner.log)
    notice = asyncio.ensure_future(_tell_server_stopped(dask, spawner))
    _NOTICES.add(notice)
    notice.add_done_callback(_NOTICES.discard)


async def _tell_server_stopped(dask: GPUDask, spawner: Any) -> None:
    try:
        await dask.server_stopped(spawner.user.name, spawner.name or "")
    except Exception:  # a server's stop must not fail for its clusters
        spawner.log.exception("gpulab: stopping the Dask clusters of %s failed", spawner._log_name)


def _clusters_parent(state: Path) -> Path:
    """`state`, absolute, with its clusters' folder made here 0711 whatever the hub's umask (077):
    owners pass through it to their own clusters' folders."""
    _passable_dir(state / CLUSTERS_DIR)
    return state.resolve()


def _passable_dir(path: Path) -> Path:
    """The clusters' folder, made 0711 (owners pass through to their own clusters' folders)."""
    path.mkdir(mode=0o711, exist_ok=True)
    os.chmod(path, 0o711)
    return path.resolve()
