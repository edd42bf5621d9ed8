"""The gpulab-metrics service's HTTP handlers: the push endpoint (a server's own token, no
cookie), and the admin's endpoints under the service's prefix (index, metrics, api/servers,
api/alerts), which identify the caller with the hub and check her rights.

Apart from `service.py` (the Application, its options and its loop), which routes to these in
`MetricsService.make_app` and hands them the aggregate and itself through the app's settings.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated
from prometheus_client import CONTENT_TYPE_LATEST
from tornado import web

from gpulab.hub.services.metrics.aggregate import Aggregate
from gpulab.hub.services.metrics.exposition import exposition
from gpulab.hub.services.metrics.listing import Target
from gpulab.hub.services.metrics.push import PushRefused

if TYPE_CHECKING:  # the service routes to these handlers; they only name its type
    from gpulab.hub.services.metrics.service import MetricsService


class JSONErrors(web.RequestHandler):
    """Errors as {"status", "message"}, the message being the HTTPError's sentence."""

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        reason = self._reason
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and exc.log_message:
            reason = exc.log_message
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": status_code, "message": reason}))


class PushHandler(JSONErrors):
    """POST /api/push/<user>[/<server>]: one server's exposition, with that server's token.

    Only the Authorization header is read (no cookie: a browser page cannot push for its
    visitor), and the hub says whose token it is; HubAuth caches that answer for a minute."""

    async def post(self, user: str, server: str | None) -> None:
        service: MetricsService = self.settings["service"]
        hub_auth: HubOAuth = self.settings["hub_auth"]
        target = Target(user, server or "")
        match = hub_auth.auth_header_pat.match(self.request.headers.get("Authorization", ""))
        try:
            if not match:
                raise PushRefused(
                    401, "a push needs its server's hub token (Authorization: token <token>)"
                )
            try:
                identity = await hub_auth.user_for_token(match.group(1), sync=False)
            except web.HTTPError as e:  # HubAuth's own 5xx: the hub is down or refused us
                raise PushRefused(
                    503, f"the hub did not identify the token ({e.log_message})"
                ) from None
            kept = await service.accept_push(identity, target, self.request.body)
        except PushRefused as e:
            service.aggregate.push_refusals_total += 1
            raise web.HTTPError(e.status, e.message) from None
        self.set_status(202)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"user": target.user, "server": target.server, "series": kept}))


class ServiceHandler(HubOAuthenticated, JSONErrors):
    """Identifies the caller with the hub (token or OAuth cookie), then checks admin rights."""

    hub_scopes = None  # any hub identity is identified; the handler decides what it may see
    allowed_scopes = frozenset({"admin:servers"})

    @property
    def hub_auth(self) -> HubOAuth:
        auth: HubOAuth = self.settings["hub_auth"]
        return auth

    @property
    def aggregate(self) -> Aggregate:
        agg: Aggregate = self.settings["aggregate"]
        return agg

    async def prepare(self) -> None:
        model = await self.hub_auth.get_user(self, sync=False)
        if not model:
            raise web.HTTPError(
                403,
                "gpulab-metrics needs an admin's hub token (Authorization: token <token>)"
                " or a token with admin:servers",
            )
        scopes = set(model.get("scopes") or [])
        # A token is judged by its scopes (an admin's token scoped down to less is not an admin's
        # token); a browser session after the hub's OAuth login by the user's admin flag.
        via_token = bool(self.hub_auth.get_token(self, in_cookie=False))
        admin_session = bool(model.get("admin")) and not via_token
        if not (admin_session or scopes & self.allowed_scopes):
            kind, name = model.get("kind", "user"), model.get("name", "?")
            needs = " or ".join(sorted(self.allowed_scopes))
            raise web.HTTPError(403, f"{kind} {name!r} is not an admin and has no {needs} scope")
        self.current_user = model

    def write_json(self, body: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class OAuthCallbackHandler(HubOAuthCallbackHandler):
    @property
    def hub_auth(self) -> HubOAuth:
        auth: HubOAuth = self.settings["hub_auth"]
        return auth


class IndexHandler(ServiceHandler):
    async def prepare(self) -> None:
        # a browser without a session is sent through the hub's OAuth login first
        if not await self.hub_auth.get_user(self, sync=False):
            self.redirect(self.get_login_url())
            return
        await super().prepare()

    def get(self) -> None:
        service: MetricsService = self.settings["service"]
        self.write_json(
            {
                "service": "gpulab-metrics",
                "endpoints": ["metrics", "api/servers", "api/alerts"],
                "push_interval_seconds": service.push_interval_seconds,
                "listing_interval_seconds": service.listing_interval_seconds,
                "rules": [r.to_text() for r in self.aggregate.rules],
            }
        )


class MetricsHandler(ServiceHandler):
    allowed_scopes = frozenset({"admin:servers", "read:metrics"})

    def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(exposition(self.aggregate))


class ServersHandler(ServiceHandler):
    def get(self) -> None:
        self.write_json(self.aggregate.servers_payload())


class AlertsHandler(ServiceHandler):
    def get(self) -> None:
        self.write_json(self.aggregate.alerts_payload())
