"""This server's client of the hub's GPU jobs API (`/hub/api/gpulab/users/<me>/jobs`, capacity).

It calls the hub with this server's own $JUPYTERHUB_API_TOKEN, straight to $JUPYTERHUB_API_URL
(never through the proxy, so polling the hub is no activity that keeps the server from culling).
The hub gives that token, besides JupyterHub's `server` role, only `read:servers!user` and
`servers!user` (`gpulab.hub.config.SERVER_TOKEN_SCOPES`): the scopes the jobs API checks, and
only on this server's owner, a subset of what she holds herself. Another tenant cannot use it:
the token lives in this server's environment, under its owner's account, and even a copy of it
names her alone in its filter, so the hub refuses it for anyone else's runs (403), which
`tests/hub/jobservice/test_lab_backend.py` checks with user B's server token against A's runs.
The hub, never this client, decides the owner and groups of a run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

#: one hub call may take this long (a submit waits for the store, never for a GPU)
TIMEOUT_SECONDS = 30.0


class HubUnavailable(RuntimeError):
    """This server runs outside a hub (no JUPYTERHUB_API_URL / token): no GPU jobs here."""


class HubError(RuntimeError):
    """The hub refused a call; ``status`` and the hub's own ``message`` (naming the field)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HubJobs:
    """The jobs and GPU profiles of this server's owner, through the hub's REST API."""

    def __init__(self, api_url: str, token: str, user: str) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.user = user

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HubJobs:
        env = os.environ if env is None else env
        url, token, user = (
            env.get("JUPYTERHUB_API_URL", ""),
            env.get("JUPYTERHUB_API_TOKEN", ""),
            env.get("JUPYTERHUB_USER", ""),
        )
        if not (url and token and user):
            raise HubUnavailable(
                "GPU jobs run through a gpulab hub; this server was not started by one "
                "(JUPYTERHUB_API_URL, JUPYTERHUB_API_TOKEN and JUPYTERHUB_USER are not all set)"
            )
        return cls(url, token, user)

    @property
    def jobs_url(self) -> str:
        return f"{self.api_url}/gpulab/users/{quote(self.user, safe='')}/jobs"

    async def call(self, method: str, url: str, body: Any = None) -> Any:
        request = HTTPRequest(
            url,
            method=method,
            headers={"Authorization": f"token {self.token}", "Accept": "application/json"},
            body=None if body is None else json.dumps(body),
            request_timeout=TIMEOUT_SECONDS,
            allow_nonstandard_methods=True,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as e:
            raise HubError(e.code, _message(e)) from None
        return json.loads(response.body or b"null")

    async def capacity(self) -> dict[str, Any]:
        """The owner's profiles with free counts and her quota (GET /hub/api/gpulab/capacity)."""
        return dict(await self.call("GET", f"{self.api_url}/gpulab/capacity"))

    async def runs(self) -> list[dict[str, Any]]:
        return list((await self.call("GET", self.jobs_url))["runs"])

    async def run(self, run_id: int) -> dict[str, Any]:
        """One run with its outputs; a queued one also with its place in the queue, which the
        hub reports in the list only (positions count every user's queued runs)."""
        run = dict(await self.call("GET", f"{self.jobs_url}/{run_id}"))
        if run.get("state") in ("queued", "preempted") and "queue_position" not in run:
            listed = next((r for r in await self.runs() if r["id"] == run["id"]), {})
            run["queue_position"] = listed.get("queue_position")
        return run

    async def submit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return dict(await self.call("POST", self.jobs_url, dict(body)))

    async def cancel(self, run_id: int) -> dict[str, Any]:
        return dict(await self.call("DELETE", f"{self.jobs_url}/{run_id}"))

    async def stream_logs(
        self,
        run_id: int,
        on_chunk: Callable[[bytes], None],
        stream: str = "stdout",
        last_event_id: str = "",
    ) -> None:
        """The run's live log as the hub's Server-Sent Events, each chunk handed on as it comes
        (the hub ends a stream after a while; the browser's EventSource reconnects with
        Last-Event-ID, which is passed on here)."""
        headers = {"Authorization": f"token {self.token}", "Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        request = HTTPRequest(
            f"{self.jobs_url}/{run_id}/logs/stream?{urlencode({'stream': stream})}",
            headers=headers,
            streaming_callback=on_chunk,
            request_timeout=3600,
        )
        # a client of its own: the shared one runs at most 10 requests at once, and open log
        # streams (one per panel, up to the hub's stream length each) must not queue the calls
        # every other panel and jupyter-scheduler make
        client = AsyncHTTPClient(force_instance=True)
        try:
            await client.fetch(request)
        except HTTPClientError as e:
            raise HubError(e.code, _message(e)) from None
        finally:
            client.close()


def _message(error: HTTPClientError) -> str:
    body = error.response.body if error.response is not None else b""
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return f"the hub answered {error.code}: {error.message}"
