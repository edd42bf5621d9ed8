"""gpulab-metrics: a JupyterHub managed service that aggregates the GPU figures of all servers.

Every scrape_interval_seconds it lists the running servers (hub API), reads each one's GPU
monitor at the server's own address (through the proxy it would count as activity and keep
idle servers from being culled), evaluates the admin's alert rules (gpulab's rule language)
per GPU, and serves under its prefix (/services/gpulab-metrics/):

- metrics      Prometheus text: every scraped gpulab_* series (labels user, server, gpu),
               gpulab_scrape_up{user,server}, hub-side alerts and the service's own figures;
- api/servers  JSON: per server its latest figures per GPU and its firing alerts;
- api/alerts   JSON: firing hub-side alerts, and idle_gpu_servers (every GPU IDLE_GPU).

All three need an admin, or a token with admin:servers (metrics also accepts read:metrics).
Run by the hub: `python -m gpulab.hub.metrics_service` (JUPYTERHUB_* environment). Options are
traitlets (`--MetricsService.scrape_interval_seconds=5`, or a config file named by
$GPULAB_METRICS_CONFIG).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from prometheus_client import CONTENT_TYPE_LATEST
from tornado import web
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from traitlets import Float, Integer, TraitError, Unicode, default, validate
from traitlets.config import Application
from traitlets.config.loader import PyFileConfigLoader

from gpulab.hub.alerts import RuleError, parse_rules

from .metrics_aggregate import Aggregate
from .metrics_exposition import exposition
from .metrics_scrape import MONITOR_PATH, ScrapeResult, Target, list_targets, scrape

DEFAULT_RULES = 'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning")'


class MetricsService(Application):
    name = "gpulab-metrics"
    description = __doc__

    scrape_interval_seconds = Float(
        15.0,
        config=True,
        help="""Seconds between two scrape cycles (list the running servers, read every monitor).""",
    )
    scrape_timeout_seconds = Float(
        config=True,
        help="""Seconds one request (hub listing or one server's metrics) may take.
        Default: the scrape interval, at most 10.""",
    )
    max_concurrent_scrapes = Integer(
        20, config=True, help="""Servers read at the same time (the rest wait their turn)."""
    )
    max_series_per_server = Integer(
        1000,
        config=True,
        help="""Series kept from one server's scrape; more are dropped (a server is user code).""",
    )
    rules = Unicode(
        DEFAULT_RULES,
        config=True,
        help="""Alert rules evaluated over every scraped GPU, in gpulab's rule language, one per
        line, e.g. IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning").""",
    )
    idle_alert = Unicode(
        "IDLE_GPU",
        config=True,
        help="""The alert whose firing on every GPU of a server puts it in api/alerts'
        idle_gpu_servers (what GPU-aware culling reads).""",
    )
    max_gap_seconds = Float(
        None,
        allow_none=True,
        config=True,
        help="""Longest pause between two scrapes of a GPU that keeps FOR timers running.
        None: 3 x the scrape spacing, at least 30 s.""",
    )
    monitor_path = Unicode(
        MONITOR_PATH, config=True, help="""Path of the monitor's metrics under a server's URL."""
    )
    config_file = Unicode(
        config=True, help="""A Python config file to load (default: $GPULAB_METRICS_CONFIG)."""
    )

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    @default("scrape_timeout_seconds")
    def _default_timeout(self) -> float:
        return min(10.0, self.scrape_interval_seconds)

    @default("config_file")
    def _default_config_file(self) -> str:
        return os.environ.get("GPULAB_METRICS_CONFIG", "")

    @validate("scrape_interval_seconds", "scrape_timeout_seconds")
    def _positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            name = proposal["trait"].name
            raise TraitError(f"MetricsService.{name} must be more than 0 seconds, not {value!r}")
        return value

    @validate("max_concurrent_scrapes", "max_series_per_server")
    def _at_least_one(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if value < 1:
            raise TraitError(
                f"MetricsService.{proposal['trait'].name} must be at least 1, not {value}"
            )
        return value

    @validate("rules")
    def _valid_rules(self, proposal: Any) -> str:
        try:
            parse_rules(proposal["value"])
        except RuleError as e:
            raise TraitError(f"MetricsService.rules: {e}") from None
        return str(proposal["value"])

    aliases = {"config": "MetricsService.config_file"}

    def initialize(self, argv: list[str] | None = None) -> None:
        self.config_error = ""
        super().initialize(argv)  # the command line is the hub's config: its errors are fatal
        try:
            if self.config_file:
                path = Path(self.config_file)
                config = PyFileConfigLoader(path.name, str(path.parent), log=self.log).load_config()
                self.update_config(config)
        except Exception as e:
            # exiting would only make the hub restart us in a loop: run, and say what is wrong
            self.config_error = f"{e} (the option keeps its default until the config is fixed)"
            self.log.error("gpulab-metrics: bad configuration: %s", self.config_error)
        self.aggregate = Aggregate(
            parse_rules(self.rules), self.idle_alert, max_gap_seconds=self.max_gap_seconds
        )
        self.aggregate.config_error = self.config_error
        self.api_url = os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")
        self.api_token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        self.prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpulab-metrics/")
        self.service_url = os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:8002")
        self.client: AsyncHTTPClient | None = None  # made on the running loop

    def http_client(self) -> AsyncHTTPClient:
        if self.client is None:
            self.client = AsyncHTTPClient(
                force_instance=True, max_clients=self.max_concurrent_scrapes, max_body_size=16 << 20
            )
        return self.client

    # -- the loop ------------------------------------------------------------------------------

    async def cycle(self) -> None:
        """One scrape cycle: list servers, scrape them concurrently, feed the rules."""
        agg, start, client = self.aggregate, time.monotonic(), self.http_client()
        try:
            targets = await list_targets(
                client,
                self.api_url,
                self.api_token,
                self.scrape_timeout_seconds,
            )
        except Exception as e:  # keep the last known servers: a hub restart is not a stop
            agg.hub_error = f"listing servers failed: {e}"
            self.log.warning("gpulab-metrics: %s", agg.hub_error)
        else:
            agg.hub_error = ""
            if self.monitor_path != MONITOR_PATH:
                targets = [
                    type(t)(
                        t.user, t.server, t.url and t.url[: -len(MONITOR_PATH)] + self.monitor_path
                    )
                    for t in targets
                ]
            agg.set_targets(targets, time.time())
        states = list(agg.servers.values())
        # at most max_concurrent_scrapes in flight: the others wait here, not in the HTTP
        # client's queue (where the wait would count against their timeout)
        slots = asyncio.Semaphore(self.max_concurrent_scrapes)

        async def one(target: Target) -> ScrapeResult:
            async with slots:
                return await scrape(
                    client,
                    target,
                    self.api_token,
                    self.scrape_timeout_seconds,
                    self.max_series_per_server,
                )

        results = await asyncio.gather(*(one(s.target) for s in states))
        for result in results:
            agg.add_result(result)
        agg.cycles += 1
        agg.last_cycle = time.time()
        agg.last_cycle_seconds = time.monotonic() - start

    async def run_loop(self) -> None:
        while True:
            start = time.monotonic()
            try:
                await self.cycle()
            except Exception:  # never let one bad cycle end the service
                self.log.exception("gpulab-metrics: scrape cycle failed")
            await asyncio.sleep(max(0.0, self.scrape_interval_seconds - (time.monotonic() - start)))

    # -- the web app ---------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        hub_auth = HubOAuth(api_url=self.api_url, api_token=self.api_token, cache_max_age=60)
        prefix = self.prefix
        settings = {
            "aggregate": self.aggregate,
            "service": self,
            "hub_auth": hub_auth,
            "cookie_secret": secrets.token_bytes(32),
            "static_path": None,
        }
        return web.Application(
            [
                (prefix, IndexHandler),
                (url_path_join(prefix, "oauth_callback"), OAuthCallbackHandler),
                (url_path_join(prefix, "metrics"), MetricsHandler),
                (url_path_join(prefix, "api/servers"), ServersHandler),
                (url_path_join(prefix, "api/alerts"), AlertsHandler),
            ],
            **settings,
        )

    def start(self) -> None:
        if not self.api_token:
            self.log.error(
                "gpulab-metrics needs $JUPYTERHUB_API_TOKEN: run it as a JupyterHub service"
            )
            sys.exit(1)
        asyncio.run(self.serve())

    async def serve(self) -> None:
        """Listen on $JUPYTERHUB_SERVICE_URL and scrape until the process ends."""
        url = urlparse(self.service_url)
        server = HTTPServer(self.make_app(), xheaders=True)
        server.listen(url.port or 80, url.hostname or "127.0.0.1")
        self.log.info(
            "gpulab-metrics on %s%s: scraping every %.0f s, rules: %s",
            self.service_url,
            self.prefix,
            self.scrape_interval_seconds,
            "; ".join(r.to_text() for r in self.aggregate.rules) or "none",
        )
        try:
            await self.run_loop()
        finally:
            server.stop()
            if self.client is not None:
                self.client.close()


class ServiceHandler(HubOAuthenticated, web.RequestHandler):
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

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        reason = self._reason
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and exc.log_message:
            reason = exc.log_message
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": status_code, "message": reason}))

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
                "scrape_interval_seconds": service.scrape_interval_seconds,
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


def main(argv: list[str] | None = None) -> None:
    MetricsService.launch_instance(argv)


if __name__ == "__main__":
    main()
