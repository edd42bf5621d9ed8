"""Dask clusters of a user (decision record 0003, its "REST contract" section).

    GET    /hub/api/gpulab/users/{user}/dask-clusters                 her clusters, newest first
                                                                      (?live=1: pending/starting/running)
    POST   /hub/api/gpulab/users/{user}/dask-clusters                 create one (201)
    GET    /hub/api/gpulab/users/{user}/dask-clusters/{id}            one cluster
    PATCH  /hub/api/gpulab/users/{user}/dask-clusters/{id}            scale, adapt, keep alive
    DELETE /hub/api/gpulab/users/{user}/dask-clusters/{id}            stop it (returns once stopped)
    GET    /hub/api/gpulab/users/{user}/dask-clusters/{id}/workers    its workers
    GET    /hub/api/gpulab/users/{user}/dask-clusters/{id}/credentials  address and TLS, owner only

Who may: `custom:gpulab:dask` on the owner (every user holds it on herself through the `user`
role, and every server's token through `Spawner.server_token_scopes`), or JupyterHub's own
`read:servers` (reading) / `servers` (changing) on her, as for her servers (admins, services).
`needs_scope` checks them with the `user` filter of the URL, so a token of bob's server, which
holds the scope on bob only, gets 404 on alice's clusters (JupyterHub's answer for a filtered
scope that does not match). A cluster is found only under its owner's name. The TLS credentials
(which let one run code in the cluster as its owner) go to the owner herself only, never to an
admin or a service acting on her.

A cluster's `server` is the server the request came from when the token is a server's own (a
notebook's `GPUCluster`), never the body's claim then; other callers may name one of the owner's
servers.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from jupyterhub.scopes import needs_scope
from jupyterhub.utils import url_escape_path, url_path_join
from tornado import web

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.dask import (
    LIVE_CLUSTER_STATES,
    MAX_WORKERS,
    Cluster,
    ClusterNameTaken,
    ClusterNotFound,
    ClusterSpec,
    ClusterSpecError,
    IllegalTransition,
    WorkerState,
)
from gpulab.hub.daskservice.hub import GPUDask
from gpulab.hub.daskservice.service import DaskRefused, DaskService
from gpulab.hub.refusals import shown
from gpulab.hub.scopes import DASK

READ, CHANGE = "read:servers", "servers"
#: spec fields the hub sets from its own record of the caller
HUB_FIELDS = ("owner", "groups")
#: ended workers listed with a cluster (the newest): its history would grow without bound
ENDED_WORKERS_SHOWN = 10


def dashboard_path(base_url: str, owner: str, cluster_id: int) -> str:
    """The hub's path of a cluster's dashboard (its root, ending in '/')."""
    return url_path_join(
        base_url, "gpulab/dask", url_escape_path(owner), str(cluster_id), "dashboard/"
    )


async def dask_service(handler: Any) -> DaskService:
    """The hub's cluster service; 501 where this hub runs no clusters, 503 while it starts."""
    dask = GPUDask.instance(config=handler.settings["config"], log=handler.log)
    await dask.wait_started(timeout=30)
    if dask.service is None:
        why = dask.unavailable or "Dask clusters are starting; try again in a moment"
        raise web.HTTPError(503 if dask.unavailable is None else 501, why)
    return dask.service


async def cluster_of(service: DaskService, owner: str, cluster_id: str) -> Cluster:
    """The cluster `cluster_id` of `owner`; 404 for an unknown id or another user's."""
    cluster = None
    if cluster_id.isascii() and cluster_id.isdigit() and len(cluster_id) <= 18:
        try:
            cluster = await asyncio.to_thread(service.store.get, int(cluster_id))
        except ClusterNotFound:
            cluster = None
    if cluster is None or cluster.owner != owner:
        raise web.HTTPError(404, f"{owner} has no Dask cluster {shown(cluster_id)}")
    return cluster


class _DaskHandler(GPULabAPIHandler):
    def owner(self, user_name: str) -> Any:
        """The hub user (the scope check has passed); 404 when she does not exist."""
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"No such user {shown(user_name)}")
        return user

    async def describe(self, service: DaskService, cluster: Cluster) -> dict[str, Any]:
        workers = await asyncio.to_thread(service.store.workers, cluster.id)
        shown_workers = [w for w in workers if w.state is not WorkerState.STOPPED]
        ended = [w for w in shown_workers if w.state in (WorkerState.FAILED, WorkerState.PREEMPTED)]
        hidden = {w.number for w in ended[:-ENDED_WORKERS_SHOWN]}
        return {
            "id": cluster.id,
            "name": cluster.name,
            "owner": cluster.owner,
            "server": cluster.spec.server,
            "profile": cluster.spec.profile,
            "state": cluster.state.value,
            "reason": service.scheduler_reason(cluster),
            "keep_alive": cluster.keep_alive,
            "n_workers": cluster.target,
            "minimum": cluster.minimum,
            "maximum": cluster.maximum,
            "preemptible": cluster.spec.preemptible,
            "idle_timeout_seconds": service.idle_timeout_of(cluster),
            "created": cluster.created_at,
            "scheduler_address": cluster.scheduler_address,
            "dashboard_link": dashboard_path(self.hub.base_url, cluster.owner, cluster.id)
            + "status",
            "workers": [
                {
                    "number": w.number,
                    "name": w.name,
                    "state": w.state.value,
                    "reason": w.reason,
                    "node": w.placement.node if w.placement else None,
                    "share": service.share_of(cluster, w),
                    "gpus": [s.uuid for s in w.placement.gpus] if w.placement else [],
                }
                for w in shown_workers
                if w.number not in hidden
            ],
            "workers_running": sum(1 for w in workers if w.state is WorkerState.RUNNING),
            "waiting_reason": service.waiting_reason(cluster, workers),
        }

    def server_of_token(self, user: Any) -> str | None:
        """The name of the owner's server whose own token made this request (None: not a
        server's token). JupyterHub notes a server's token as 'Server at <its URL>'."""
        token = self.get_token()
        if token is None or token.user is None or token.user.id != user.orm_user.id:
            return None
        for name in user.orm_spawners:
            url = url_path_join(user.base_url, url_escape_path(name), "/")
            if token.note == f"Server at {url}":
                return str(name)
        return None

    def _caller(self) -> str:
        return str(getattr(self.current_user, "name", "") or "a service")


class DaskClustersAPIHandler(_DaskHandler):
    @needs_scope(DASK, READ)
    async def get(self, user_name: str) -> None:
        self.owner(user_name)
        service = await dask_service(self)
        live = self.get_argument("live", "") in ("1", "true", "yes")
        clusters = await asyncio.to_thread(
            service.store.list_clusters,
            owner=user_name,
            states=set(LIVE_CLUSTER_STATES) if live else None,
        )
        out = [await self.describe(service, c) for c in sorted(clusters, key=lambda c: -c.id)]
        self.write({"clusters": out})

    @needs_scope(DASK, CHANGE)
    async def post(self, user_name: str) -> None:
        user = self.owner(user_name)
        service = await dask_service(self)
        body = self.get_json_body() or {}
        if not isinstance(body, dict):
            raise web.HTTPError(400, "The body must be a JSON object (a cluster's fields)")
        for name in HUB_FIELDS:
            if name in body:
                raise web.HTTPError(400, f"{name}: set by the hub from the user, not the request")
        values = dict(body)
        values.setdefault("name", f"dask-{secrets.token_hex(3)}")
        if "n_workers" not in values and values.get("minimum") is not None:
            values["n_workers"] = values["minimum"]  # adaptive: it starts at its minimum
        own_server = self.server_of_token(user)
        if own_server is not None:
            values["server"] = own_server  # a server's token speaks for its server only
        server = values.get("server", "")
        if isinstance(server, str) and server and server not in user.orm_spawners:
            raise web.HTTPError(400, f"server: {user_name} has no server named {shown(server)}")
        groups = sorted(g.name for g in user.groups)
        try:
            spec = ClusterSpec.from_dict({**values, "owner": user_name, "groups": groups})
            cluster = await service.create(spec, is_admin=bool(user.admin))
        except ClusterSpecError as e:
            raise web.HTTPError(400, str(e)) from None
        except DaskRefused as e:
            raise web.HTTPError(e.status, str(e)) from None
        except ClusterNameTaken as e:
            raise web.HTTPError(409, f"name: {e}") from None
        self.set_status(201)
        self.write(await self.describe(service, cluster))


class DaskClusterAPIHandler(_DaskHandler):
    @needs_scope(DASK, READ)
    async def get(self, user_name: str, cluster_id: str) -> None:
        self.owner(user_name)
        service = await dask_service(self)
        cluster = await cluster_of(service, user_name, cluster_id)
        self.write(await self.describe(service, cluster))

    @needs_scope(DASK, CHANGE)
    async def patch(self, user_name: str, cluster_id: str) -> None:
        self.owner(user_name)
        service = await dask_service(self)
        cluster = await cluster_of(service, user_name, cluster_id)
        body = self.get_json_body() or {}
        if not isinstance(body, dict):
            raise web.HTTPError(400, "The body must be a JSON object")
        keys = set(body)
        try:
            if keys == {"n_workers"}:
                changed = await service.scale(cluster.id, _count(body, "n_workers"))
            elif keys == {"minimum", "maximum"}:
                low, high = _count(body, "minimum"), _count(body, "maximum")
                if high < max(low, 1):
                    raise web.HTTPError(400, f"maximum: must be at least minimum and 1, got {high}")
                changed = await service.adapt(cluster.id, low, high)
            elif keys == {"keep_alive"}:
                if not isinstance(body["keep_alive"], bool):
                    raise web.HTTPError(400, "keep_alive: must be true or false")
                changed = await service.set_keep_alive(cluster.id, body["keep_alive"])
            else:
                raise web.HTTPError(
                    400,
                    f"{', '.join(sorted(map(str, keys))) or 'body'}: send one of "
                    '{"n_workers": n}, {"minimum": a, "maximum": b} or {"keep_alive": bool}',
                )
        except ClusterSpecError as e:
            raise web.HTTPError(400, str(e)) from None
        except DaskRefused as e:
            raise web.HTTPError(e.status, str(e)) from None
        except IllegalTransition as e:
            raise web.HTTPError(409, e.reason) from None
        self.write(await self.describe(service, changed))

    @needs_scope(DASK, CHANGE)
    async def delete(self, user_name: str, cluster_id: str) -> None:
        self.owner(user_name)
        service = await dask_service(self)
        cluster = await cluster_of(service, user_name, cluster_id)
        stopped = await service.stop(cluster.id, reason=f"stopped by {self._caller()}")
        self.write(await self.describe(service, stopped))


class DaskWorkersAPIHandler(_DaskHandler):
    @needs_scope(DASK, READ)
    async def get(self, user_name: str, cluster_id: str) -> None:
        self.owner(user_name)
        service = await dask_service(self)
        cluster = await cluster_of(service, user_name, cluster_id)
        model = await self.describe(service, cluster)
        self.write({"workers": model["workers"], "waiting_reason": model["waiting_reason"]})


class DaskCredentialsAPIHandler(_DaskHandler):
    @needs_scope(DASK, CHANGE)
    async def get(self, user_name: str, cluster_id: str) -> None:
        user = self.owner(user_name)
        # The TLS key lets its holder run code in the cluster as its owner: it goes to the owner
        # herself (her login, her token, her server's token), never to an admin or a service
        # that holds `servers` on her, and another user's token never passes the scope check.
        caller = self.current_user
        if getattr(caller, "orm_user", None) is None or caller.name != user.name:
            raise web.HTTPError(403, "A cluster's credentials are given to its owner only")
        service = await dask_service(self)
        cluster = await cluster_of(service, user_name, cluster_id)
        tls = await service.tls_of(cluster.id)
        if not cluster.scheduler_address or tls is None or not cluster.is_live:
            raise web.HTTPError(
                409,
                f"cluster {cluster.name!r} is {cluster.state.value}: its scheduler does not "
                "accept connections (yet)",
            )
        self.set_header("Cache-Control", "no-store")
        self.write(
            {
                "scheduler_address": cluster.scheduler_address,
                "tls_cert": tls.cert_pem,
                "tls_key": tls.key_pem,
            }
        )


def _count(body: dict[str, Any], name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WORKERS:
        raise web.HTTPError(
            400, f"{name}: a whole number from 0 to {MAX_WORKERS}, not {shown(str(value))}"
        )
    return value


_USER = r"/api/gpulab/users/([^/]+)/dask-clusters"

default_handlers: list[tuple[str, type[Any]]] = [
    (_USER, DaskClustersAPIHandler),
    (_USER + r"/([^/]+)", DaskClusterAPIHandler),
    (_USER + r"/([^/]+)/workers", DaskWorkersAPIHandler),
    (_USER + r"/([^/]+)/credentials", DaskCredentialsAPIHandler),
]
