"""A Dask cluster's dashboard through the hub: /hub/gpulab/dask/{user}/{id}/dashboard/...

The scheduler's dashboard listens where only the hub reaches it (the executor's `dashboard_url`:
loopback under a per-cluster secret prefix, or a Service only the hub may reach), so a kept-alive
cluster's dashboard works with its server stopped, and nobody reaches it around the hub. Every
request is authenticated as the hub's own pages and API are: the hub's login cookie (a browser,
the lab's dashboard panes) or a token, and needs `custom:gpulab:dask` or JupyterHub's `servers`
on the owner (`needs_scope` with the URL's user: another user gets 404, as for her clusters).

HTTP requests are forwarded as they are (method, body, the headers that describe content), and
their answers come back with the upstream's own headers in place of the hub's defaults (its
Content-Type above all: a stylesheet stays ``text/css``) and the upstream's prefix rewritten to
the hub's in redirects and in text (Bokeh writes absolute URLs of its prefix into pages and
scripts), so the secret prefix is never needed by the browser. Websockets (Bokeh's live panes)
are relayed message by message.
Cookies and the Authorization header are not forwarded: the hub's credentials are the hub's.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from jupyterhub.handlers.base import BaseHandler
from jupyterhub.scopes import needs_scope
from tornado import httpclient, web, websocket

from gpulab.hub.apihandlers.dask import cluster_of, dashboard_path, dask_service
from gpulab.hub.scopes import DASK

#: request headers passed upstream (no cookies, no Authorization: they are the hub's)
FORWARDED_REQUEST_HEADERS = ("Accept", "Accept-Encoding", "Content-Type", "If-None-Match", "Range")
#: answer headers not passed back (hop-by-hop, or recomputed by tornado)
DROPPED_ANSWER_HEADERS = {
    "connection",
    "content-length",
    "transfer-encoding",
    "keep-alive",
    "set-cookie",
    "server",
    "date",
    "content-encoding",
}
TEXT_TYPES = ("text/", "application/javascript", "application/json")
MAX_BODY_BYTES = 64 * 1024 * 1024


class DaskDashboardHandler(websocket.WebSocketHandler, BaseHandler):
    """One handler for both: an upgrade request becomes a relayed websocket, anything else an
    HTTP request forwarded upstream."""

    upstream_ws: websocket.WebSocketClientConnection | None = None
    #: a token (a notebook's, a script's) as well as the login cookie: JupyterHub's pages take
    #: cookies only; the scope check below applies to either
    _accept_token_auth = True

    async def _upstream(self, user_name: str, cluster_id: str, path: str) -> tuple[str, str]:
        """(the upstream URL of `path`, the upstream's dashboard root) of a live cluster."""
        if self.find_user(user_name) is None:
            raise web.HTTPError(404, "No such user")
        service = await dask_service(self)
        cluster = await cluster_of(service, user_name, cluster_id)
        if not cluster.is_live or not cluster.dashboard_url:
            raise web.HTTPError(
                404, f"cluster {cluster.name!r} is {cluster.state.value}: it has no dashboard now"
            )
        root = cluster.dashboard_url.rstrip("/") + "/"
        url = root + path.lstrip("/")
        if self.request.query:
            url += "?" + self.request.query
        return url, root

    def _public_root(self, user_name: str, cluster_id: str) -> str:
        return dashboard_path(self.hub.base_url, user_name, int(cluster_id))

    # -- HTTP ----------------------------------------------------------------------------------

    @needs_scope(DASK, "servers")
    async def get(self, user_name: str, cluster_id: str, path: str) -> None:
        if self.request.headers.get("Upgrade", "").lower() == "websocket":
            url, _root = await self._upstream(user_name, cluster_id, path)
            self._ws_target = "ws" + url[len("http") :] if url.startswith("http") else url
            await websocket.WebSocketHandler.get(self, user_name, cluster_id, path)
            return
        await self._forward(user_name, cluster_id, path)

    @needs_scope(DASK, "servers")
    async def post(self, user_name: str, cluster_id: str, path: str) -> None:
        await self._forward(user_name, cluster_id, path)

    async def _forward(self, user_name: str, cluster_id: str, path: str) -> None:
        url, root = await self._upstream(user_name, cluster_id, path)
        headers = {k: v for k, v in self.request.headers.items() if k in FORWARDED_REQUEST_HEADERS}
        headers.pop("Accept-Encoding", None)  # text is rewritten: ask for it uncompressed
        request = httpclient.HTTPRequest(
            url,
            method=self.request.method,
            headers=headers,
            body=self.request.body if self.request.method == "POST" else None,
            follow_redirects=False,
            request_timeout=60,
            validate_cert=False,  # the dashboard's own certificate, if any, is the cluster's
        )
        client = httpclient.AsyncHTTPClient(max_body_size=MAX_BODY_BYTES)
        answer = await client.fetch(request, raise_error=False)
        if answer.code == 599:
            raise web.HTTPError(502, f"the cluster's dashboard does not answer: {answer.error}")
        public = self._public_root(user_name, cluster_id)
        upstream_path = urlsplit(root).path
        self.set_status(answer.code, answer.reason)
        passed: set[str] = set()
        for name, value in answer.headers.get_all():
            if name.lower() in DROPPED_ANSWER_HEADERS:
                continue
            if name.lower() == "location":
                value = _rewrite(value, root, upstream_path, public)
            if name.lower() in passed:
                self.add_header(name, value)  # a header the upstream repeats, repeated
            else:
                # the first replaces the hub's default of that name: tornado starts every
                # answer with "Content-Type: text/html", and a second Content-Type beside it
                # makes browsers take a stylesheet or script for HTML (an unstyled dashboard)
                self.set_header(name, value)
                passed.add(name.lower())
        body = answer.body or b""
        content_type = answer.headers.get("Content-Type", "")
        if body and content_type.startswith(TEXT_TYPES):
            body = _rewrite(body.decode("utf-8", "replace"), root, upstream_path, public).encode()
        if body:
            self.write(body)

    # -- websockets ----------------------------------------------------------------------------

    def select_subprotocol(self, subprotocols: list[str]) -> str | None:
        # Bokeh offers ["bokeh", <session token>] and expects "bokeh" back
        self._subprotocols = subprotocols
        return subprotocols[0] if subprotocols else None

    async def open(self, *args: Any, **kwargs: Any) -> None:
        request = httpclient.HTTPRequest(self._ws_target, validate_cert=False, request_timeout=30)
        try:
            self.upstream_ws = await websocket.websocket_connect(
                request,
                on_message_callback=self._from_upstream,
                subprotocols=getattr(self, "_subprotocols", None) or None,
                max_message_size=MAX_BODY_BYTES,
            )
        except Exception as e:
            self.log.warning("Dask dashboard websocket %s: %s", self.request.path, e)
            self.close(1011, "the cluster's dashboard does not answer")

    def _from_upstream(self, message: str | bytes | None) -> None:
        if message is None:  # the upstream closed
            self.close()
            return
        if self.ws_connection is None:
            return
        asyncio.ensure_future(self._send(message))

    async def _send(self, message: str | bytes) -> None:
        try:
            await self.write_message(message, binary=isinstance(message, bytes))
        except websocket.WebSocketClosedError:
            if self.upstream_ws is not None:
                self.upstream_ws.close()

    async def on_message(self, message: str | bytes) -> None:
        if self.upstream_ws is not None:
            await self.upstream_ws.write_message(message, binary=isinstance(message, bytes))

    def on_close(self) -> None:
        if self.upstream_ws is not None:
            self.upstream_ws.close()
            self.upstream_ws = None


def _rewrite(text: str, root: str, upstream_path: str, public: str) -> str:
    """`text` with the upstream's dashboard root (absolute URL, then path) made the hub's."""
    text = text.replace(root, public)
    if upstream_path not in ("", "/"):
        text = text.replace(upstream_path, public)
    return text


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/gpulab/dask/([^/]+)/([0-9]+)/dashboard/(.*)", DaskDashboardHandler),
]
