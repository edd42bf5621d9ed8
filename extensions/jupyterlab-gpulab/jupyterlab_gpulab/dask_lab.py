"""dask-labextension on gpulab: its sidebar lists the hub's clusters of this server's owner.

dask-labextension (7.x) makes clusters in this server's process through ``labextension.factory``
and lists only those. Here (decision record 0003):

* the factory is ``gpulab.dask.GPUCluster`` with the owner's default Dask profile (her server's
  own profile when it gives a GPU, else her first profile that does), so the sidebar's "+NEW"
  asks the hub;
* its cluster manager is ``HubClusterManager``: it lists every live cluster of the owner from the
  hub (made from any notebook or server of hers), asks each running one's scheduler for its
  workers, cores and memory at every refresh, and scales, adapts and stops through the hub.
  dask-labextension 7 reads its manager from its modules' global ``manager`` (not from
  ``settings["dask_cluster_manager"]``, which later versions read): both are set;
* the sidebar's "insert client code" writes ``Client("tls://<scheduler>")``, the address only:
  this server's kernels get ``gpulab.dask.security_loader`` as distributed's
  ``distributed.client.security-loader``, which gives such a client the cluster's credentials;
* its dashboard check fetches a dashboard from this server, without the browser's cookies: for
  the hub's dashboards of this owner it sends this server's token (which the hub takes for her
  clusters only), so the sidebar finds their panes, which the browser then loads from the hub
  with its own login;
* ``gpulab/dask/clusters`` (POST) is the "New GPU cluster" dialog's: dask-labextension's create
  call carries no body, so the profile, worker count and keep-alive come this way.

Another tenant cannot use any of this for her own ends: every hub call carries this server's
token, whose dask scope names this server's owner only (the hub answers 404 for anyone else's
clusters); whoever reaches these handlers is the owner or someone JupyterHub let into her server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from dask_labextension.manager import DaskClusterManager
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gpulab.dask import ClusterInfo, HubDask, HubDaskError, HubUnavailable
from gpulab.dask.cluster import security_of
from gpulab.dask.hubapi import dashboard_url
from gpulab.spawner.names import PROFILE_ENV

from . import jobmapping

log = logging.getLogger(__name__)

NAMESPACE = "gpulab/dask"
#: the sidebar polls its list every few seconds; the hub is asked at most this often
REFRESH_SECONDS = 1.0
#: how long a scheduler may take to say how many workers it has (else: the hub's count)
SCHEDULER_TIMEOUT_SECONDS = 10.0
#: distributed's setting for the credentials of a ``Client(address)`` given none, as this
#: server's kernels see it (dask reads its settings from ``DASK_*`` variables at import)
SECURITY_LOADER_ENV = "DASK_DISTRIBUTED__CLIENT__SECURITY_LOADER"
SECURITY_LOADER = "gpulab.dask.security_loader"
#: the lab's cluster ids must look like UUIDs (dask-labextension's route takes only
#: `\w+-\w+-\w+-\w+-\w+`): the hub's number, written in the last group
_ID_PREFIX = "00000000-0000-0000-0000-"


def lab_id(hub_id: int) -> str:
    return f"{_ID_PREFIX}{hub_id:012d}"


def hub_id(cluster_id: str) -> int | None:
    """The hub's cluster number of a lab id (None: not one of the hub's)."""
    if not cluster_id.startswith(_ID_PREFIX):
        return None
    tail = cluster_id[len(_ID_PREFIX) :]
    return int(tail) if tail.isdigit() else None


def default_profile(profiles: list[Mapping[str, Any]], own: str) -> str | None:
    """The owner's default Dask profile: her server's own when it gives a GPU, else the first
    of hers that does, else her first (a CPU cluster), None when she has none."""
    gpu = [p["slug"] for p in profiles if jobmapping.has_gpu(p)]
    if own and own in gpu:
        return own
    if gpu:
        return str(gpu[0])
    return str(profiles[0]["slug"]) if profiles else None


def factory_config(profile: str | None) -> dict[str, Any]:
    """dask-labextension's ``labextension.factory``: GPUCluster with the default profile."""
    kwargs: dict[str, Any] = {} if profile is None else {"profile": profile}
    return {"module": "gpulab.dask", "class": "GPUCluster", "args": [], "kwargs": kwargs}


def cluster_model(
    info: ClusterInfo, scheduler: Mapping[str, Any] | None = None, origin: str = ""
) -> dict[str, Any]:
    """dask-labextension's cluster model of a hub cluster; workers, cores and memory from the
    scheduler's last answer (its ``identity``) when there is one, else the hub's count of
    running workers. The dashboard link
    is absolute (the sidebar takes a bare path for one under this server): the hub's public URL
    when JupyterHub named one, else ``origin``, where the browser reached this server (the
    proxy, which routes /hub/ to the hub)."""
    from dask.utils import format_bytes

    model: dict[str, Any] = {
        "id": lab_id(info.id),
        "name": info.name,
        "scheduler_address": info.scheduler_address or "",
        "dashboard_link": _absolute(dashboard_url(info.dashboard_link), origin)
        if info.state == "running"
        else "",
        "workers": int(scheduler["n_workers"]) if scheduler else info.workers_running,
        "memory": format_bytes(int(scheduler.get("total_memory") or 0) if scheduler else 0),
        "cores": int(scheduler.get("total_threads") or 0) if scheduler else 0,
        # gpulab's own fields (the sidebar ignores them; the dialog and tests read them)
        "hub_id": info.id,
        "state": info.state,
        "profile": info.profile,
        "keep_alive": info.keep_alive,
        "target_workers": info.n_workers,
        "waiting_reason": info.waiting_reason,
    }
    if info.adaptive:
        model["adapt"] = {"minimum": info.minimum, "maximum": info.maximum}
    return model


def _absolute(link: str, origin: str) -> str:
    return origin.rstrip("/") + link if link.startswith("/") and origin else link


class HubClusterManager(DaskClusterManager):  # type: ignore[misc]
    """dask-labextension's manager over the hub's clusters (see the module docstring).

    It holds no ``Cluster`` of a cluster it lists, only an ``rpc`` to its scheduler, asked at
    every refresh: distributed's ``Cluster`` learns of workers by subscribing to the scheduler,
    which keeps one subscriber only (its plugin has a fixed name), so a notebook's GPUCluster
    connecting later took the updates from the sidebar's, which then showed the old worker
    count for as long as the server ran."""

    def __init__(self, hub: HubDask) -> None:
        super().__init__()
        self.hub = hub
        self._infos: dict[str, ClusterInfo] = {}
        #: an rpc to each running cluster's scheduler, and its last answer
        self._peers: dict[str, Any] = {}
        self._schedulers: dict[str, dict[str, Any]] = {}
        self._refreshing = asyncio.Lock()
        self._refreshed = 0.0
        self._refresh_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        #: scheme and host the browser reaches this server at (set by the sidebar's requests)
        self.origin = ""

    # -- the hub's list ------------------------------------------------------------------------

    async def refresh(self) -> None:
        async with self._refreshing:
            self._refreshed = time.monotonic()
            infos = await self.hub.list(live=True)
            self._infos = {lab_id(i.id): i for i in infos}
            running = {
                cid
                for cid, i in self._infos.items()
                if i.state == "running" and i.scheduler_address
            }
            for gone in set(self._peers) - running:
                await self._disconnect(gone)
            await asyncio.gather(*(self._ask_scheduler(cid) for cid in running))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refresh_soon(self) -> None:
        """Ask the hub again (in the background) when the last answer is older than a second:
        the sidebar's next poll shows it. Only while someone looks: no polling otherwise."""
        if self._refresh_task is not None and not self._refresh_task.done():
            return
        if time.monotonic() - self._refreshed < REFRESH_SECONDS:
            return

        async def run() -> None:
            try:
                await self.refresh()
            except (HubDaskError, OSError) as e:
                log.warning("gpulab dask: listing the hub's clusters failed: %s", e)

        self._refresh_task = asyncio.ensure_future(run())

    async def _ask_scheduler(self, cid: str) -> None:
        """The scheduler's count of workers, cores and memory now (connecting with the
        cluster's credentials first, once)."""
        from distributed.core import rpc

        info = self._infos[cid]
        try:
            peer = self._peers.get(cid)
            if peer is None:
                credentials = await self.hub.credentials(info.id)
                security = security_of(credentials)
                peer = rpc(
                    credentials.scheduler_address,
                    connection_args=security.get_connection_args("client"),
                )
                self._peers[cid] = peer
            # n_workers=0: the totals without every worker's description
            self._schedulers[cid] = await asyncio.wait_for(
                peer.identity(n_workers=0), SCHEDULER_TIMEOUT_SECONDS
            )
        except Exception as e:  # stopped meanwhile, or not reachable: the hub's count
            log.info("gpulab dask: cluster %r did not answer: %s", info.name, e)
            await self._disconnect(cid)

    async def _disconnect(self, cid: str) -> None:
        peer = self._peers.pop(cid, None)
        self._schedulers.pop(cid, None)
        if peer is not None:
            try:  # bounded: a scheduler gone mid-comm can leave distributed's close waiting
                await asyncio.wait_for(peer.close_rpc(), SCHEDULER_TIMEOUT_SECONDS)
            except Exception as e:
                log.info("gpulab dask: disconnecting from %s: %s", cid, e)

    def _model(self, cid: str) -> dict[str, Any] | None:
        info = self._infos.get(cid)
        if info is None:
            return None
        return cluster_model(info, self._schedulers.get(cid), self.origin)

    # -- dask-labextension's interface ---------------------------------------------------------

    def list_clusters(self) -> list[dict[str, Any]]:
        self._refresh_soon()
        return [m for cid in self._infos if (m := self._model(cid)) is not None]

    def get_cluster(self, cluster_id: str) -> dict[str, Any] | None:
        self._refresh_soon()
        return self._model(cluster_id)

    async def start_cluster(
        self, cluster_id: str = "", configuration: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The sidebar's "+NEW": a cluster of the factory's (the default profile), made by the
        hub. It is kept alive: a cluster made from the sidebar is the owner's, not a kernel's."""
        from dask_labextension.manager import make_cluster

        cluster, _adaptive = await make_cluster(configuration or {})
        cluster.shutdown_on_close = False
        await cluster.close()  # disconnects only: the list asks its scheduler (class docstring)
        await self.refresh()
        return self._model(lab_id(cluster.cluster_id)) or {}

    async def create(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The dialog's create: the hub makes it (its answer right away, pending or starting);
        the sidebar lists it from the next poll."""
        info = await self.hub.create(spec)
        await self.refresh()
        return cluster_model(info)

    async def close_cluster(self, cluster_id: str) -> dict[str, Any] | None:
        number = hub_id(cluster_id)
        if number is None:
            return None
        info = await self.hub.delete(number)
        await self._disconnect(cluster_id)
        self._infos.pop(cluster_id, None)
        return cluster_model(info)

    async def scale_cluster(self, cluster_id: str, n: int) -> dict[str, Any] | None:
        number = hub_id(cluster_id)
        if number is None:
            return None
        info = await self.hub.patch(number, {"n_workers": int(n)})
        self._infos[cluster_id] = info
        return cluster_model(info, self._schedulers.get(cluster_id), self.origin)

    def adapt_cluster(self, cluster_id: str, minimum: int, maximum: int) -> dict[str, Any] | None:
        """dask-labextension calls this without awaiting: the hub is asked in the background
        (a refusal is logged; the list shows the hub's bounds from the next poll)."""
        number = hub_id(cluster_id)
        info = self._infos.get(cluster_id)
        if number is None or info is None:
            return None

        async def patch() -> None:
            try:
                self._infos[cluster_id] = await self.hub.patch(
                    number, {"minimum": int(minimum), "maximum": int(maximum)}
                )
            except HubDaskError as e:
                log.warning("gpulab dask: adapt %s refused: %s", info.name, e)

        self._spawn(patch())
        model = cluster_model(info, self._schedulers.get(cluster_id), self.origin)
        model["adapt"] = {"minimum": minimum, "maximum": maximum}
        return model

    async def close(self) -> None:
        """This server stops: disconnect only. Its clusters are the hub's, which stops those
        not kept alive when the server stops."""
        for cid in list(self._peers):
            await self._disconnect(cid)


def dashboard_check_handler() -> type:
    """dask-labextension's dashboard check, which also reaches the hub's dashboards of this
    server's owner (with this server's token: the check runs here, without the browser's
    cookies)."""
    from dask_labextension.dashboardhandler import (
        DaskDashboardCheckHandler,
        _normalize_dashboard_link,
    )

    class HubDashboardCheckHandler(DaskDashboardCheckHandler):  # type: ignore[misc,valid-type]
        @web.authenticated
        async def get(self, url: str) -> None:
            manager = self.settings.get("dask_cluster_manager")
            hub = getattr(manager, "hub", None)
            link = _normalize_dashboard_link(unquote(url), self.request)
            upstream = None if hub is None else hub_dashboard_url(link, hub, self.request.host)
            if hub is None or upstream is None:
                await super().get(url)
                return
            request = HTTPRequest(
                url_path_join(upstream, "individual-plots.json"),
                headers={"Authorization": f"token {hub.token}"},
                follow_redirects=False,
                request_timeout=30,
            )
            try:
                answer = await AsyncHTTPClient().fetch(request)
                plots = json.loads(answer.body)
                active = isinstance(plots, dict)
            except (HTTPClientError, OSError, ValueError) as e:
                log.info("gpulab dask: dashboard %s is not active: %s", link, e)
                plots, active = {}, False
            self.finish(json.dumps({"url": link, "isActive": active, "plots": plots}))

    return HubDashboardCheckHandler


def dashboard_proxy_handler() -> type:
    """dask-labextension's dashboard proxy (``dask/dashboard/{id}/...``, what its panes and
    its check use once a cluster is clicked in the sidebar), for the hub's clusters: to the
    hub's dashboard of the cluster, at the hub's own address, with this server's token. Its
    stock one proxies to the dashboard link's host and port and drops its path, which the hub's
    dashboards (under /hub/gpulab/dask/...) need. The pages the hub answers name the hub's
    public paths, which the browser then loads from the hub with its own login."""
    from urllib.parse import quote, urlsplit

    from dask_labextension.dashboardhandler import DaskDashboardHandler
    from jupyter_server_proxy.handlers import ProxyHandler

    class HubDashboardProxyHandler(DaskDashboardHandler):  # type: ignore[misc,valid-type]
        _hub_token = ""
        _hub_host = ""

        def _hub_target(self, cluster_id: str) -> tuple[str, int, str] | None:
            manager = self.settings.get("dask_cluster_manager")
            hub = getattr(manager, "hub", None)
            number = hub_id(cluster_id)
            if hub is None or number is None:
                return None
            api = urlsplit(hub.api_url)
            hub_prefix = api.path.rsplit("/api", 1)[0]
            prefix = f"{hub_prefix}/gpulab/dask/{quote(hub.user, safe='')}/{number}/dashboard"
            self._hub_token, self._hub_host = hub.token, api.hostname or ""
            port = api.port or (443 if api.scheme == "https" else 80)
            return self._hub_host, port, prefix

        def proxy(self, cluster_id: str, proxied_path: str) -> Any:
            target = self._hub_target(cluster_id)
            if target is None:
                return super().proxy(cluster_id, proxied_path)
            host, port, prefix = target
            return ProxyHandler.proxy(self, host, port, prefix + proxied_path)

        async def open(self, cluster_id: str, proxied_path: str) -> Any:
            target = self._hub_target(cluster_id)
            if target is None:
                return await super().open(cluster_id, proxied_path)
            host, port, prefix = target
            return await ProxyHandler.proxy_open(self, host, port, prefix + proxied_path)

        def get_request_headers_override(self) -> dict[str, str]:
            # the token goes to the hub's own address only (`_hub_target`)
            return {"Authorization": f"token {self._hub_token}"} if self._hub_token else {}

        def set_header(self, name: str, value: Any) -> None:
            super().set_header(name, _frameable(name, value))

        def add_header(self, name: str, value: Any) -> None:
            super().add_header(name, _frameable(name, value))

        def _check_host_allowlist(self, host: str) -> bool:
            return bool(self._hub_host and host == self._hub_host) or bool(
                super()._check_host_allowlist(host)
            )

    return HubDashboardProxyHandler


def _frameable(name: str, value: Any) -> Any:
    """The hub forbids framing its pages (``frame-ancestors 'none'``); a dashboard pane is this
    server's page in an iframe of the lab, the same origin: framing by that origin only."""
    if name.lower() == "content-security-policy" and isinstance(value, str):
        return value.replace("frame-ancestors 'none'", "frame-ancestors 'self'")
    return value


def cluster_handler() -> type:
    """dask-labextension's cluster API, telling the manager where the browser reaches this
    server (for absolute dashboard links) before it answers."""
    from dask_labextension.clusterhandler import DaskClusterHandler

    class HubClusterHandler(DaskClusterHandler):  # type: ignore[misc,valid-type]
        def prepare(self) -> Any:
            manager = self.settings.get("dask_cluster_manager")
            if isinstance(manager, HubClusterManager):
                manager.origin = f"{self.request.protocol}://{self.request.host}"
            return super().prepare()

    return HubClusterHandler


def hub_dashboard_url(link: str, hub: HubDask, own_host: str = "") -> str | None:
    """Where to fetch `link` with this server's token, when it is one of the owner's
    dashboards on the hub: the same path at the hub's own (API) address, so the token goes to
    the hub and nowhere else, whatever host the URL (from the browser) names. None for any
    other URL: a host that is not the hub's (its API's, its public one, or the one the browser
    reached this server through, the proxy's), another user's dashboards, or a path that
    leaves the dashboards ('..')."""
    from urllib.parse import quote, urlsplit

    parts, api = urlsplit(link), urlsplit(hub.api_url)
    hosts = {api.netloc, own_host}
    for name in ("JUPYTERHUB_PUBLIC_HUB_URL", "JUPYTERHUB_PUBLIC_URL"):
        if os.environ.get(name):
            hosts.add(urlsplit(os.environ[name]).netloc)
    hub_prefix = api.path.rsplit("/api", 1)[0]  # "/hub" under the hub's base URL
    mine = f"{hub_prefix}/gpulab/dask/{quote(hub.user, safe='')}/"
    if parts.netloc not in hosts - {""} or not parts.path.startswith(mine):
        return None
    if ".." in parts.path or "%" in parts.path.removeprefix(mine):
        return None
    return f"{api.scheme}://{api.netloc}{parts.path}"


class ClustersHandler(APIHandler):
    """POST gpulab/dask/clusters: the "New GPU cluster" dialog (profile, n_workers, keep_alive,
    name). 201 with the cluster's model; the hub's refusal (403 quota, 400 naming the field)
    passes through with its message."""

    _track_activity = False

    @web.authenticated
    async def post(self) -> None:
        manager = self.settings.get("dask_cluster_manager")
        if not isinstance(manager, HubClusterManager):
            raise web.HTTPError(
                501, "Dask clusters run through a gpulab hub; none runs this server"
            )
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise web.HTTPError(400, "The body must be JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "The body must be a JSON object")
        allowed = {"profile", "n_workers", "keep_alive", "name", "minimum", "maximum"}
        extra = sorted(set(body) - allowed)
        if extra:
            raise web.HTTPError(400, f"{extra[0]}: not a field of a new cluster here")
        try:
            model = await manager.create(body)
        except HubDaskError as e:
            raise web.HTTPError(e.status if 400 <= e.status < 600 else 502, e.message) from None
        self.set_status(201)
        self.finish(json.dumps(model))


def _replace_handler(router: Any, old: type, new: type) -> int:
    """Swap a handler class in the web app's routing tables (dask-labextension registers its
    own; tornado keeps the first rule that matches a path). Returns how many were swapped."""
    swapped = 0
    for rule in getattr(router, "rules", []):
        if rule.target is old:
            rule.target = new
            swapped += 1
        else:
            swapped += _replace_handler(rule.target, old, new)
    return swapped


def setup_dask_lab(server_app: Any) -> HubClusterManager | None:
    """Wire dask-labextension to the hub, where both are here (a server the hub started, with
    dask-labextension installed); None elsewhere, leaving it stock."""
    import dask
    from dask_labextension import clusterhandler, dashboardhandler
    from dask_labextension import manager as manager_module
    from dask_labextension.dashboardhandler import DaskDashboardCheckHandler

    try:
        hub = HubDask.from_env()
    except HubUnavailable:
        return None
    web_app = server_app.web_app
    if not dask.config.get("distributed.client.security-loader", None):
        # for the kernels this server starts (they inherit its environment); not one of hers,
        # which she may have set to her own loader
        os.environ.setdefault(SECURITY_LOADER_ENV, SECURITY_LOADER)
    own = os.environ.get(PROFILE_ENV, "")
    # until the hub's profiles are read (at start), the server's own profile is the default
    dask.config.set({"labextension.factory": factory_config(own or None)})
    manager = HubClusterManager(hub)
    web_app.settings["dask_cluster_manager"] = manager
    for module in (manager_module, clusterhandler, dashboardhandler):
        module.manager = manager
    from dask_labextension.clusterhandler import DaskClusterHandler
    from dask_labextension.dashboardhandler import DaskDashboardHandler

    for old, new in (
        (DaskDashboardCheckHandler, dashboard_check_handler()),
        (DaskClusterHandler, cluster_handler()),
        (DaskDashboardHandler, dashboard_proxy_handler()),
    ):
        _replace_handler(web_app.default_router, old, new)
        _replace_handler(web_app.wildcard_router, old, new)
    base = url_path_join(web_app.settings["base_url"], NAMESPACE)
    web_app.add_handlers(".*$", [(url_path_join(base, "clusters"), ClustersHandler)])
    return manager


async def start_dask_lab(server_app: Any, manager: HubClusterManager) -> None:
    """Read the owner's profiles from the hub and make the default the factory's."""
    import dask

    from .hubjobs import HubError, HubJobs

    try:
        capacity = await HubJobs.from_env().capacity()
    except (HubError, OSError) as e:
        server_app.log.warning("gpulab dask: the hub's profiles are unavailable: %s", e)
        return
    own = os.environ.get(PROFILE_ENV, "")
    profile = default_profile(list(capacity.get("profiles", [])), own)
    dask.config.set({"labextension.factory": factory_config(profile)})
    server_app.log.info("gpulab dask: the Dask sidebar makes clusters of profile %r", profile)
