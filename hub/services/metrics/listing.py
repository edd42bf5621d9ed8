"""Which servers run and which job runs and Dask workers hold a GPU, as the hub lists them, for the
gpulab-metrics service.

The service never calls a user's server: servers push their figures (hub/services/metrics/push.py). It
asks the hub only which servers exist, with a role of list:users, read:users and read:servers,
and which workloads hold GPU shares (custom:gpulab:allocations:read), so that it can refuse pushes
for workloads that do not run and forget those that stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from gpulab.spawner.names import is_workload_name

PAGINATION = "application/jupyterhub-pagination+json"
ROLE_HINT = (
    "the gpulab-metrics role needs list:users, read:users, read:servers and"
    " custom:gpulab:allocations:read"
)


@dataclass(frozen=True)
class Target:
    """One running server, or one job run or Dask worker holding a GPU share (`server` is then
    its workload name, "job-17" or "dask-3-w2", which no named server may take)."""

    user: str
    server: str  # "" for the default server

    @property
    def key(self) -> str:
        return f"{self.user}/{self.server}"

    @property
    def is_workload(self) -> bool:
        """A job run or a Dask worker, not a server."""
        return is_workload_name(self.server)


def targets_from_allocations(allocations: Iterable[dict[str, Any]]) -> list[Target]:
    """The job runs and Dask workers among the hub's allocations (GET /gpulab/allocations):
    an allocation id is "<owner>/<workload name>"."""
    out = set()
    for allocation in allocations:
        owner, sep, name = str(allocation.get("id", "")).rpartition("/")
        if sep and owner and is_workload_name(name):
            out.add(Target(owner, name))
    return sorted(out, key=lambda t: (t.user, t.server))


def targets_from_users(users: Iterable[dict[str, Any]]) -> list[Target]:
    """Every server of the hub API's user models (GET /users?state=active), ready or starting:
    a starting server's extension may push before the hub has seen it answer."""
    out = [
        Target(str(user["name"]), str(name))
        for user in users
        for name in (user.get("servers") or {})
    ]
    return sorted(out, key=lambda t: (t.user, t.server))


async def _get(client: AsyncHTTPClient, url: str, token: str, timeout_seconds: float) -> Any:
    response = await client.fetch(
        HTTPRequest(
            url,
            headers={"Authorization": f"token {token}", "Accept": PAGINATION},
            connect_timeout=timeout_seconds,
            request_timeout=timeout_seconds,
        ),
        raise_error=False,
    )
    if response.code == 404:
        return None
    if response.code != 200:
        body = response.body.decode(errors="replace")[:300] if response.body else ""
        raise RuntimeError(
            f"GET {url} answered {response.code} {body or response.reason} ({ROLE_HINT})"
        )
    return json.loads(response.body)


async def _get_paginated(
    client: AsyncHTTPClient, url: str, token: str, timeout_seconds: float, page_size: int
) -> list[Any]:
    """Every page of a hub API listing."""
    out: list[Any] = []
    offset = 0
    while True:
        query = urlencode({"offset": offset, "limit": page_size})
        page = await _get(
            client, f"{url}{'&' if '?' in url else '?'}{query}", token, timeout_seconds
        )
        if page is None:
            raise RuntimeError(f"GET {url} answered 404 (is this a JupyterHub API URL?)")
        if not isinstance(page, dict) or "items" not in page:  # a hub without pagination
            return list(page)
        items = list(page["items"])
        out.extend(items)
        following = (page.get("_pagination") or {}).get("next")
        if not following or not items:
            return out
        offset = int(following.get("offset", offset + len(items)))


async def list_targets(
    client: AsyncHTTPClient,
    api_url: str,
    token: str,
    timeout_seconds: float,
    page_size: int = 200,
) -> list[Target]:
    """Every running server. Raises on hub errors."""
    users = await _get_paginated(
        client, f"{api_url.rstrip('/')}/users?state=active", token, timeout_seconds, page_size
    )
    return targets_from_users(users)


async def server_runs(
    client: AsyncHTTPClient, api_url: str, token: str, timeout_seconds: float, target: Target
) -> bool:
    """Whether the hub has `target` running (or starting) now. Raises on hub errors."""
    model = await _get(
        client, f"{api_url.rstrip('/')}/users/{quote(target.user, safe='')}", token, timeout_seconds
    )
    return bool(model) and target.server in (model.get("servers") or {})


async def list_workloads(
    client: AsyncHTTPClient, api_url: str, token: str, timeout_seconds: float
) -> list[Target]:
    """Every job run and Dask worker holding a GPU share now. Raises on hub errors."""
    body = await _get(client, f"{api_url.rstrip('/')}/gpulab/allocations", token, timeout_seconds)
    if body is None:
        raise RuntimeError(f"GET {api_url}/gpulab/allocations answered 404 (is this a gpulab hub?)")
    return targets_from_allocations(body.get("allocations") or [])


async def workload_runs(
    client: AsyncHTTPClient, api_url: str, token: str, timeout_seconds: float, target: Target
) -> bool:
    """Whether the hub's allocator holds `target`'s (a job run's or Dask worker's) share now."""
    return target in await list_workloads(client, api_url, token, timeout_seconds)
