"""The hub's Dask REST API (decision record 0003, "REST contract") as this server sees it.

Calls go straight to $JUPYTERHUB_API_URL with this server's own $JUPYTERHUB_API_TOKEN. That token
holds `custom:gpulab:dask` on its owner only (the hub's user filter), so even a copy of it in
another tenant's hands manages nobody's clusters but this server's owner's, and the hub refuses
it on another user's URL (404). Nothing here decides ownership: the hub does.

Pure parsing (`ClusterInfo.from_json`, `error_of`) is separate from the HTTP so that it can be
tested on its own; the HTTP itself is tested against the real hub (the e2e tests).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

#: one hub call may take this long; DELETE answers once the cluster is stopped (the hub's kill
#: schedule ends within 60 s), so it gets longer
TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 120.0
#: the states in which a cluster is alive (its name is taken, it may be scaled)
LIVE_STATES = frozenset({"pending", "starting", "running"})


class HubDaskError(RuntimeError):
    """The hub refused a call: ``status`` and the hub's own ``message`` (it names the field,
    the limit, or the cluster)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class DaskQuotaError(HubDaskError):
    """403: the request would exceed the owner's quota; the message names the limit and the
    most workers that fit. Nothing was changed."""


class DaskClusterNotFound(HubDaskError):
    """404: no such cluster of this user (or it is another user's)."""


class DaskNameTaken(HubDaskError):
    """409 on create: a live cluster of this user already has the name."""


class HubUnavailable(RuntimeError):
    """This process was not started by a gpulab hub (its API URL, token or user is missing)."""


def error_of(status: int, body: bytes | None, reason: str = "") -> HubDaskError:
    """The exception for a refused call: JupyterHub's ``{"status", "message"}`` body, its
    message kept word for word (a quota refusal's text is what the user must read)."""
    try:
        message = str(json.loads(body or b"")["message"])
    except (ValueError, KeyError, TypeError):
        message = f"the hub answered {status}" + (f": {reason}" if reason else "")
    kind: type[HubDaskError] = {
        403: DaskQuotaError,
        404: DaskClusterNotFound,
        409: DaskNameTaken,
    }.get(status, HubDaskError)
    return kind(status, message)


@dataclass(frozen=True)
class WorkerInfo:
    number: int
    name: str
    state: str
    reason: str | None = None
    node: str | None = None
    share: str | None = None
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterInfo:
    """A cluster as the hub describes it (the contract's cluster object)."""

    id: int
    name: str
    owner: str
    state: str
    profile: str | None = None
    server: str | None = None
    reason: str | None = None
    keep_alive: bool = False
    n_workers: int = 0
    minimum: int | None = None
    maximum: int | None = None
    idle_timeout_seconds: float | None = None
    created: Any = None
    scheduler_address: str | None = None
    dashboard_link: str = ""
    workers: tuple[WorkerInfo, ...] = ()
    workers_running: int = 0
    waiting_reason: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def adaptive(self) -> bool:
        return self.minimum is not None and self.maximum is not None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClusterInfo:
        """Parse the hub's cluster object; raises ValueError naming a missing or bad field
        (a hub of another version, rather than a KeyError deep in the caller)."""
        try:
            workers = tuple(
                WorkerInfo(
                    number=int(w["number"]),
                    name=str(w["name"]),
                    state=str(w["state"]),
                    reason=w.get("reason"),
                    node=w.get("node"),
                    share=w.get("share"),
                    gpus=tuple(w.get("gpus") or ()),
                )
                for w in data.get("workers") or ()
            )
            return cls(
                id=int(data["id"]),
                name=str(data["name"]),
                owner=str(data["owner"]),
                state=str(data["state"]),
                profile=data.get("profile"),
                server=data.get("server"),
                reason=data.get("reason"),
                keep_alive=bool(data.get("keep_alive", False)),
                n_workers=int(data.get("n_workers") or 0),
                minimum=_int_or_none(data.get("minimum")),
                maximum=_int_or_none(data.get("maximum")),
                idle_timeout_seconds=data.get("idle_timeout_seconds"),
                created=data.get("created"),
                scheduler_address=data.get("scheduler_address") or None,
                dashboard_link=str(data.get("dashboard_link") or ""),
                workers=workers,
                workers_running=int(data.get("workers_running") or 0),
                waiting_reason=data.get("waiting_reason"),
                raw=dict(data),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the hub's cluster object is not understood ({e!r}): {data}") from e


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Credentials:
    """What a client needs to reach the scheduler: its address and the cluster's TLS (PEM; the
    certificate is its own CA). Kept in memory only."""

    scheduler_address: str
    tls_cert: str
    tls_key: str = field(repr=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Credentials:
        try:
            return cls(str(data["scheduler_address"]), str(data["tls_cert"]), str(data["tls_key"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"the hub's credentials lack {e}") from e


def dashboard_url(path: str, env: Mapping[str, str] | None = None) -> str:
    """The absolute URL of the hub's ``path`` (a dashboard link) as a browser reaches it: the
    hub's public URL when JupyterHub told the server one, else the path as it is (the lab is
    served from the hub's origin, so a browser resolves it there)."""
    env = os.environ if env is None else env
    if not path or "://" in path:
        return path
    public = env.get("JUPYTERHUB_PUBLIC_HUB_URL") or env.get("JUPYTERHUB_PUBLIC_URL") or ""
    if not public:
        return path
    # the public URL's own path already holds the hub's base URL, which `path` starts with
    scheme, _, rest = public.partition("://")
    origin = f"{scheme}://{rest.split('/', 1)[0]}"
    return origin + path


class HubDask:
    """Calls to the hub's Dask clusters API for one user."""

    def __init__(self, api_url: str, token: str, user: str) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.user = user

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HubDask:
        env = os.environ if env is None else env
        url, token, user = (
            env.get("JUPYTERHUB_API_URL", ""),
            env.get("JUPYTERHUB_API_TOKEN", ""),
            env.get("JUPYTERHUB_USER", ""),
        )
        if not (url and token and user):
            raise HubUnavailable(
                "gpulab.dask clusters are made by a gpulab hub; this process was not started by "
                "one (JUPYTERHUB_API_URL, JUPYTERHUB_API_TOKEN and JUPYTERHUB_USER are not all set)"
            )
        return cls(url, token, user)

    @property
    def clusters_url(self) -> str:
        return f"{self.api_url}/gpulab/users/{quote(self.user, safe='')}/dask-clusters"

    async def call(
        self, method: str, path: str = "", body: Any = None, timeout: float = TIMEOUT_SECONDS
    ) -> Any:
        request = HTTPRequest(
            self.clusters_url + path,
            method=method,
            headers={
                "Authorization": f"token {self.token}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            },
            body=None if body is None else json.dumps(body),
            request_timeout=timeout,
            allow_nonstandard_methods=True,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as e:
            answer = e.response
            raise error_of(e.code, answer.body if answer else None, e.message or "") from None
        return json.loads(response.body or b"null")

    async def list(self, live: bool = True) -> list[ClusterInfo]:
        answer = await self.call("GET", "?live=1" if live else "")
        return [ClusterInfo.from_json(c) for c in answer["clusters"]]

    async def get(self, cluster_id: int) -> ClusterInfo:
        return ClusterInfo.from_json(await self.call("GET", f"/{cluster_id}"))

    async def by_name(self, name: str) -> ClusterInfo:
        for cluster in await self.list(live=True):
            if cluster.name == name:
                return cluster
        raise DaskClusterNotFound(404, f"{self.user} has no live Dask cluster named {name!r}")

    async def create(self, spec: Mapping[str, Any]) -> ClusterInfo:
        return ClusterInfo.from_json(await self.call("POST", "", dict(spec)))

    async def patch(self, cluster_id: int, change: Mapping[str, Any]) -> ClusterInfo:
        return ClusterInfo.from_json(await self.call("PATCH", f"/{cluster_id}", dict(change)))

    async def delete(self, cluster_id: int) -> ClusterInfo:
        answer = await self.call("DELETE", f"/{cluster_id}", timeout=STOP_TIMEOUT_SECONDS)
        return ClusterInfo.from_json(answer)

    async def credentials(self, cluster_id: int) -> Credentials:
        return Credentials.from_json(await self.call("GET", f"/{cluster_id}/credentials"))

    async def wait_running(
        self, cluster_id: int, timeout: float, poll_seconds: float = 0.5
    ) -> tuple[ClusterInfo, Credentials]:
        """The cluster and its credentials once its scheduler accepts connections. Raises
        HubDaskError with the hub's reason when it failed or stopped, TimeoutError (naming why
        it still waits) after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = await self.get(cluster_id)
            if info.state == "running" and info.scheduler_address:
                try:
                    return info, await self.credentials(cluster_id)
                except HubDaskError as e:
                    if e.status != 409:  # 409: not accepting connections yet
                        raise
            elif not info.is_live:
                raise HubDaskError(
                    409,
                    f"Dask cluster {info.name!r} is {info.state}"
                    + (f": {info.reason}" if info.reason else ""),
                )
            if loop.time() >= deadline:
                why = info.reason or info.waiting_reason or ""
                raise TimeoutError(
                    f"Dask cluster {info.name!r} is still {info.state} after {timeout:g} s"
                    + (f": {why}" if why else "")
                )
            await asyncio.sleep(poll_seconds)
