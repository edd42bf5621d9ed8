"""GPUCluster: a Dask cluster the hub owns, used from a notebook like any distributed cluster.

The hub creates, places, scales (adaptively too: the hub asks the scheduler, so it goes on when
the kernel ends) and stops the cluster; this object only asks it to, through the hub's REST API
(`hubapi.HubDask`), and connects to the scheduler with the cluster's own TLS credentials, which
the hub gives its owner only. The credentials stay in memory (distributed's `Security` takes PEM
text; to load a key it writes it for an instant into a fresh 0700 temporary directory, readable
by the owner only, and removes it): nothing of them is written where another account reads.
"""

from __future__ import annotations

import asyncio
import html
import logging
import os
import warnings
from collections.abc import Generator, Mapping
from typing import Any

from distributed.core import Status, rpc
from distributed.deploy.cluster import Cluster
from distributed.security import Security

from gpulab.spawner.names import PROFILE_ENV

from .hubapi import ClusterInfo, Credentials, HubDask, HubDaskError, HubUnavailable, dashboard_url

log = logging.getLogger(__name__)

#: how long creating or finding a cluster waits for its scheduler (the hub places it like any
#: server: a busy machine may make it wait); the error then says why it waits
START_TIMEOUT_SECONDS = 300.0


def security_of(credentials: Credentials) -> Security:
    """The client side of the cluster's mutual TLS, from PEM text held in memory."""
    return Security(
        tls_ca_file=credentials.tls_cert,
        tls_client_cert=credentials.tls_cert,
        tls_client_key=credentials.tls_key,
        require_encryption=True,
    )


def create_body(
    profile: str | None,
    n_workers: int | None,
    name: str | None,
    keep_alive: bool,
    environment: Mapping[str, str] | None,
    idle_timeout: float | None,
    preemptible: bool | None,
) -> dict[str, Any]:
    """The POST body of a new cluster: only what the caller chose (the hub fills the rest)."""
    body: dict[str, Any] = {"keep_alive": bool(keep_alive)}
    if profile is not None:
        body["profile"] = profile
    if n_workers is not None:
        body["n_workers"] = n_workers
    if name is not None:
        body["name"] = name
    if environment:
        body["environment"] = dict(environment)
    if idle_timeout is not None:
        body["idle_timeout_seconds"] = idle_timeout
    if preemptible is not None:
        body["preemptible"] = preemptible
    return body


class HubAdaptive:
    """What ``GPUCluster.adapt`` returns: the bounds the hub scales between (the hub runs the
    loop, not this process). Await it to see the hub's answer (a refusal raises); ``stop()``
    does nothing here, since adaptivity ends by a ``scale(n)``, which the hub takes instead."""

    def __init__(self, minimum: int, maximum: int, request: asyncio.Future[Any] | None) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.request = request
        self.periodic_callback = None  # distributed's widget reads it

    def stop(self) -> None:
        """Adaptivity belongs to the hub; it ends with the next scale()."""

    def __await__(self) -> Generator[Any, None, HubAdaptive]:
        if self.request is not None:
            yield from self.request.__await__()
        return self

    def __repr__(self) -> str:
        return f"<HubAdaptive minimum={self.minimum} maximum={self.maximum}>"


class GPUCluster(Cluster):
    """A Dask cluster of GPU workers, owned by the hub (decision record 0003).

    >>> cluster = GPUCluster(profile="1/4 GPU", n_workers=4)
    >>> client = cluster.get_client()
    >>> cluster.adapt(minimum=0, maximum=8)   # the hub scales it, even after the kernel ends
    >>> cluster.close()                        # stops it, unless keep_alive=True

    ``profile``: one of the hub's profiles (the server's own by default, per the hub);
    ``n_workers``: workers to start (each admitted on its own, like servers and jobs);
    ``keep_alive``: outlive this server (it still stops when idle); ``name``: find it again with
    ``GPUCluster.from_name`` from any server of yours; ``environment``: variables for workers.
    Refusals raise ``HubDaskError`` (``DaskQuotaError`` when over quota) with the hub's message.
    """

    def __init__(
        self,
        profile: str | None = None,
        n_workers: int | None = None,
        *,
        name: str | None = None,
        keep_alive: bool = False,
        environment: Mapping[str, str] | None = None,
        idle_timeout: float | None = None,
        preemptible: bool | None = None,
        start_timeout: float = START_TIMEOUT_SECONDS,
        shutdown_on_close: bool | None = None,
        asynchronous: bool = False,
        loop: Any = None,
        hub: HubDask | None = None,
        _existing: ClusterInfo | None = None,
    ) -> None:
        self.hub = hub or HubDask.from_env()
        if profile is None:
            # the hub needs one: this server's own, as the spawner named it
            profile = os.environ.get(PROFILE_ENV) or None
        self.start_timeout = start_timeout
        self.info: ClusterInfo | None = _existing
        self._create_body = (
            None
            if _existing is not None
            else create_body(
                profile, n_workers, name, keep_alive, environment, idle_timeout, preemptible
            )
        )
        # a cluster found by name is someone's (another server's, perhaps): closing this view
        # leaves it running unless asked; one made here stops with close() unless kept alive
        self.shutdown_on_close = (
            shutdown_on_close
            if shutdown_on_close is not None
            else (_existing is None and not keep_alive)
        )
        self.security: Security | None = None
        self._adapt_requests: set[asyncio.Future[Any]] = set()
        super().__init__(
            asynchronous=asynchronous,
            loop=loop,
            name=name or (_existing.name if _existing else None),
        )
        # the loop the cluster's comms run on: the caller's when asynchronous, else a thread's
        self._loop_runner.start()
        if not self.asynchronous:
            self.sync(self._start)

    # -- start and stop ------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, GPUCluster]:
        async def start() -> GPUCluster:
            if self.status == Status.created:
                await self._start()
            return self

        return start().__await__()

    async def _start(self) -> None:
        if self.status != Status.created:
            return
        self.status = Status.starting
        created_here = self.info is None
        if self.info is None:
            assert self._create_body is not None
            self.info = await self.hub.create(self._create_body)
        self.name = self.info.name
        try:
            self.info, credentials = await self.hub.wait_running(self.info.id, self.start_timeout)
            self.security = security_of(credentials)
            self.scheduler_comm = rpc(
                credentials.scheduler_address,
                connection_args=self.security.get_connection_args("client"),
            )
            await super()._start()
        except BaseException:
            self.status = Status.failed
            if created_here and self.shutdown_on_close:
                # nothing half-done: a cluster made here that we cannot use is stopped again
                await self._stop_quietly()
            raise

    async def _stop_quietly(self) -> None:
        if self.info is None:
            return
        try:
            self.info = await self.hub.delete(self.info.id)
        except Exception as e:  # the original error matters more; say what is left
            log.warning("Dask cluster %r could not be stopped: %s", self.name, e)

    async def _close(self) -> None:
        if self.status == Status.closed:
            return
        for request in self._adapt_requests:
            request.cancel()
        if self.scheduler_comm is not None:
            await super()._close()
        if self.shutdown_on_close and self.info is not None:
            self.info = await self.hub.delete(self.info.id)
        self.status = Status.closed

    def close(self, timeout: float | None = None) -> Any:
        closed = super().close(timeout=timeout)
        if not self.asynchronous:
            self._loop_runner.stop()
        return closed

    def shutdown(self) -> Any:
        """Stop the cluster now (also when it is kept alive or was found by name)."""
        self.shutdown_on_close = True
        return self.close()

    # -- scaling (in the hub) ------------------------------------------------------------------

    async def _patch(self, change: Mapping[str, Any]) -> ClusterInfo:
        info = self._require_info()
        self.info = await self.hub.patch(info.id, change)
        return self.info

    def scale(self, n: int) -> Any:
        """Ask the hub for ``n`` workers (ends adaptive scaling). A count over the quota is
        refused whole (DaskQuotaError naming the limit); awaitable when asynchronous."""
        return self.sync(self._patch, {"n_workers": int(n)})

    def adapt(self, minimum: int = 0, maximum: int = 1, **_ignored: Any) -> HubAdaptive:  # type: ignore[override]
        """Let the hub scale between ``minimum`` and ``maximum`` workers from the scheduler's
        load (it clips the target to the quota). distributed's other options (interval, wait
        counts) are the hub's, so they are ignored here."""
        change = {"minimum": int(minimum), "maximum": int(maximum)}
        if self.asynchronous:
            request = asyncio.ensure_future(self._patch(change))
            self._adapt_requests.add(request)
            request.add_done_callback(self._adapt_done)
            self._adaptive = HubAdaptive(change["minimum"], change["maximum"], request)
        else:
            self.sync(self._patch, change)
            self._adaptive = HubAdaptive(change["minimum"], change["maximum"], None)
        return self._adaptive

    def _adapt_done(self, request: asyncio.Future[Any]) -> None:
        self._adapt_requests.discard(request)
        if not request.cancelled() and request.exception() is not None:
            log.warning("Dask cluster %r: adapt refused: %s", self.name, request.exception())

    def keep_alive(self, keep: bool = True) -> Any:
        """Outlive this server (True) or stop with it (False); it still stops when idle."""
        return self.sync(self._patch, {"keep_alive": bool(keep)})

    def refresh(self) -> Any:
        """Read the cluster's state from the hub again (``self.info``)."""
        return self.sync(self._refresh)

    async def _refresh(self) -> ClusterInfo:
        self.info = await self.hub.get(self._require_info().id)
        return self.info

    def _require_info(self) -> ClusterInfo:
        if self.info is None:
            raise RuntimeError("the cluster has not been created yet (await it first)")
        return self.info

    # -- finding clusters ----------------------------------------------------------------------

    @classmethod
    def from_name(
        cls,
        name: str,
        *,
        asynchronous: bool = False,
        shutdown_on_close: bool = False,
        hub: HubDask | None = None,
        **kwargs: Any,
    ) -> Any:
        """Connect to your live cluster ``name``, made from any of your servers. Closing the
        result disconnects only, unless ``shutdown_on_close``. With ``asynchronous=True``
        returns an awaitable."""
        hub = hub or HubDask.from_env()

        async def find() -> GPUCluster:
            info = await hub.by_name(name)
            cluster = cls(
                _existing=info,
                hub=hub,
                asynchronous=True,
                shutdown_on_close=shutdown_on_close,
                **kwargs,
            )
            return await cluster

        if asynchronous:
            return find()
        info = _run_sync(hub.by_name(name))
        return cls(_existing=info, hub=hub, shutdown_on_close=shutdown_on_close, **kwargs)

    # -- what the notebook shows ---------------------------------------------------------------

    @property
    def cluster_id(self) -> int | None:
        return self.info.id if self.info else None

    @property
    def dashboard_link(self) -> str:
        """The dashboard through the hub (works with this server stopped, for a kept-alive
        cluster); absolute where the hub's public URL is known."""
        return dashboard_url(self.info.dashboard_link) if self.info else ""

    def _scaling_status(self) -> str:
        info = self.info
        running = len(self.scheduler_info.get("workers", {}))
        if info is None:
            return ""
        if info.adaptive:
            mode = f"Adaptive in the hub ({info.minimum} to {info.maximum})"
        else:
            mode = "Manual"
        rows = [
            f"Scaling mode: {mode}",
            f"Workers: {running} / {info.n_workers}",
            f"Profile: {info.profile or ''}",
            f"State: {info.state}" + (f" ({info.reason})" if info.reason else ""),
            f"Keep alive: {'yes' if info.keep_alive else 'no (stops with its server)'}",
        ]
        if info.waiting_reason:
            rows.append(f"Waiting: {info.waiting_reason}")
        body = "".join(
            f'<tr><td style="text-align: left;">{html.escape(r)}</td></tr>' for r in rows
        )
        return f"<table>{body}</table>"

    def _repr_html_(self, cluster_status: str | None = None) -> str:
        return str(
            super()._repr_html_(cluster_status=self._scaling_status() + (cluster_status or ""))
        )

    def __repr__(self) -> str:
        info = self.info
        where = f"{info.state}, {info.workers_running}/{info.n_workers} workers" if info else "new"
        return f"GPUCluster({self.name!r}, {self.scheduler_address!r}, {where})"


def _run_sync(awaitable: Any) -> Any:
    """Run a coroutine to its end from synchronous code, also inside a notebook whose thread
    already runs an event loop (then in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(awaitable)
    import concurrent.futures

    async def run() -> Any:
        return await awaitable

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


def security_loader(info: Mapping[str, Any]) -> Security | None:
    """distributed's ``distributed.client.security-loader``, which gpulab's lab servers set for
    their kernels: ``Client("tls://...")`` given only the scheduler address of one of your
    live clusters (what the Dask sidebar's "insert client code" writes) connects with that
    cluster's credentials, as ``Client(cluster)`` does. None, so distributed's own defaults
    apply, for any other address, outside a server the hub started, or when the hub cannot be
    asked (with a warning saying why).

    It asks the hub with this server's own token, which reaches her clusters only: an address
    of another user's cluster matches none of them, and no credentials come back for it."""
    address = str(info.get("address") or "")
    if not address.startswith("tls://"):
        return None
    try:
        hub = HubDask.from_env()
    except HubUnavailable:
        return None
    try:
        credentials = _run_sync(_credentials_at(hub, address))
    except (HubDaskError, OSError, ValueError) as e:
        warnings.warn(
            f"gpulab.dask: the hub could not say whether {address} is one of your clusters: {e}",
            stacklevel=2,
        )
        return None
    return None if credentials is None else security_of(credentials)


async def _credentials_at(hub: HubDask, address: str) -> Credentials | None:
    for cluster in await hub.list(live=True):
        if cluster.scheduler_address == address:
            return await hub.credentials(cluster.id)
    return None


def list_clusters(
    live: bool = True, *, asynchronous: bool = False, hub: HubDask | None = None
) -> Any:
    """Every Dask cluster of yours, from all your servers, newest first (``live=False``: also
    the stopped and failed ones, with their reasons). Awaitable when ``asynchronous``."""
    client = hub or HubDask.from_env()
    if asynchronous:
        return client.list(live=live)
    return _run_sync(client.list(live=live))


__all__ = [
    "GPUCluster",
    "HubAdaptive",
    "HubDaskError",
    "list_clusters",
    "security_loader",
    "security_of",
]
