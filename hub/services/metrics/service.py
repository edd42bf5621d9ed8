"""gpulab-metrics: a JupyterHub managed service that aggregates the GPU figures of all servers.

Servers push: every server's GPU monitor (jupyterlab-gpulab) POSTs its Prometheus exposition to
<service URL>/api/push/<user>[/<server>] every $GPULAB_METRICS_PUSH_INTERVAL_SECONDS with the
server's own JUPYTERHUB_API_TOKEN (hub/services/metrics/push.py says who may report for what). The
service calls no user server, so its role holds no access:servers and no proxy scope: a token
that reaches a user's server is never worth more than that user's access. Every
listing_interval_seconds it lists the running servers (hub API), forgets those that stopped and
marks down those whose pushes went stale; it evaluates the admin's alert rules (gpulab's rule
language) per GPU as pushes arrive, and serves under its prefix (/services/gpulab-metrics/):

- metrics      Prometheus text: every pushed gpulab_* series (labels user, server, gpu),
               gpulab_scrape_up{user,server}, hub-side alerts and the service's own figures;
- api/servers  JSON: per server its latest figures per GPU and its firing alerts;
- api/alerts   JSON: firing hub-side alerts, and idle_gpu_servers (every GPU IDLE_GPU).

All three need an admin, or a token with admin:servers (metrics also accepts read:metrics).
The push endpoint is outside the prefix on purpose: the proxy never routes it, so a push never
passes the proxy, whose activity tracking would keep idle servers from being culled.
Run by the hub: `python -m gpulab.hub.services.metrics.service` (JUPYTERHUB_* environment). Options are
traitlets (`--MetricsService.listing_interval_seconds=5`, or a config file named by
$GPULAB_METRICS_CONFIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuth
from jupyterhub.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from traitlets import Float, Integer, TraitError, Unicode, default, validate
from traitlets.config import Application
from traitlets.config.loader import PyFileConfigLoader

from gpulab.hub.alerts import RuleError, parse_rules
from gpulab.hub.ledger.store import LedgerStore
from gpulab.hub.services.metrics.aggregate import Aggregate
from gpulab.hub.services.metrics.handlers import (
    AlertsHandler,
    IndexHandler,
    MetricsHandler,
    OAuthCallbackHandler,
    PushHandler,
    ServersHandler,
)
from gpulab.hub.services.metrics.listing import (
    Target,
    list_targets,
    list_workloads,
    server_runs,
    workload_runs,
)
from gpulab.hub.services.metrics.push import PushRefused, authorize_push, push_result
from gpulab.hub.services.metrics.usage import LiveSlices, UsageMeter
from gpulab.spawner.names import (
    DEFAULT_PUSH_INTERVAL_SECONDS,
    LEDGER_DB_URL_ENV,
    METRICS_CONFIG_ENV,
    PUSH_INTERVAL_ENV,
    PUSH_PATH,
)

DEFAULT_RULES = 'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning")'


class MetricsService(Application):
    name = "gpulab-metrics"
    description = __doc__

    listing_interval_seconds = Float(
        15.0,
        config=True,
        help="""Seconds between two listings of the running servers (hub API): servers that
        stopped are forgotten (their alerts resolve), servers whose pushes are stale are down.""",
    )
    push_interval_seconds = Float(
        config=True,
        help="""Seconds between two pushes of one server, as the hub tells the servers
        ($GPULAB_METRICS_PUSH_INTERVAL_SECONDS, set by hub/jupyterhub_config.py; default 15).""",
    )
    stale_after_seconds = Float(
        config=True,
        help="""A server whose last push is older than this is down and its figures leave the
        exposition. Default: 3 x push_interval_seconds.""",
    )
    min_push_interval_seconds = Float(
        config=True,
        help="""A server's pushes closer together than this are refused with 429 (a server is
        user code; it cannot make the service parse without pause). Default: half the push
        interval, at most 1 s (room for a late push followed by a punctual one).""",
    )
    max_push_bytes = Integer(
        1 << 20,
        config=True,
        help="""Largest push body accepted (bytes); larger ones get 413. Bodies over 4 x this
        are cut off by the HTTP server itself.""",
    )
    hub_timeout_seconds = Float(
        10.0, config=True, help="""Seconds one request to the hub API may take."""
    )
    max_series_per_server = Integer(
        1000,
        config=True,
        help="""Series kept from one server's push; more are dropped (a server is user code).""",
    )
    rules = Unicode(
        DEFAULT_RULES,
        config=True,
        help="""Alert rules evaluated over every pushed GPU, in gpulab's rule language, one per
        line, e.g. IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning").""",
    )
    idle_alert = Unicode(
        "IDLE_GPU",
        config=True,
        help="""The alert whose firing on every GPU of a server puts it in api/alerts'
        idle_gpu_servers (what GPU-aware culling reads).""",
    )
    idle_utilization_pct = Float(
        5.0,
        config=True,
        help="""A GPU slice below this utilisation (%) is idle: the admin panel's GPU-idle time
        counts from when it went below without a gap (the culler's default threshold too).""",
    )
    max_gap_seconds = Float(
        None,
        allow_none=True,
        config=True,
        help="""Longest pause between two pushes of a GPU that keeps FOR timers running.
        None: 3 x the push spacing, at least 30 s.""",
    )
    config_file = Unicode(
        config=True, help="""A Python config file to load (default: $GPULAB_METRICS_CONFIG)."""
    )

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO

    @default("push_interval_seconds")
    def _default_push_interval(self) -> float:
        raw = os.environ.get(PUSH_INTERVAL_ENV, "")
        try:
            return float(raw) if raw else DEFAULT_PUSH_INTERVAL_SECONDS
        except ValueError:
            raise TraitError(f"${PUSH_INTERVAL_ENV}={raw!r} is not a number of seconds") from None

    @default("min_push_interval_seconds")
    def _default_min_push_interval(self) -> float:
        return min(1.0, self.push_interval_seconds / 2)

    @default("stale_after_seconds")
    def _default_stale_after(self) -> float:
        return 3 * self.push_interval_seconds

    @default("config_file")
    def _default_config_file(self) -> str:
        return os.environ.get(METRICS_CONFIG_ENV, "")

    @validate(
        "listing_interval_seconds",
        "push_interval_seconds",
        "stale_after_seconds",
        "hub_timeout_seconds",
    )
    def _positive(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            name = proposal["trait"].name
            raise TraitError(f"MetricsService.{name} must be more than 0 seconds, not {value!r}")
        return value

    @validate("min_push_interval_seconds")
    def _not_negative(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value >= 0:
            raise TraitError(
                f"MetricsService.min_push_interval_seconds must be >= 0, not {value!r}"
            )
        return value

    @validate("max_series_per_server", "max_push_bytes")
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
        # the GPU-hour ledger's database (set by gpulab.hub.config for hub-side processes only)
        self.ledger_url = os.environ.get(LEDGER_DB_URL_ENV, "")
        self.ledger: LedgerStore | None = None
        gap = max(30.0, 3 * self.push_interval_seconds)
        self.usage = UsageMeter(max_gap_seconds=gap)
        self.live = LiveSlices(idle_pct=self.idle_utilization_pct, max_gap_seconds=gap)
        self._live_writer: asyncio.Task[None] | None = None
        self._ledger_opening = asyncio.Lock()
        self.api_url = os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")
        self.api_token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
        self.prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpulab-metrics/")
        self.service_url = os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:8002")
        self.client: AsyncHTTPClient | None = None  # made on the running loop
        #: the job runs and Dask workers of the last listing that worked, and why the latest failed
        self._workloads: list[Target] = []
        self._workloads_error = ""

    def http_client(self) -> AsyncHTTPClient:
        if self.client is None:
            self.client = AsyncHTTPClient(force_instance=True, max_body_size=64 << 20)
        return self.client

    # -- the loop ------------------------------------------------------------------------------

    async def cycle(self) -> None:
        """One listing: which servers run; the stopped ones are forgotten, stale ones down."""
        agg, start = self.aggregate, time.monotonic()
        try:
            targets = await list_targets(
                self.http_client(), self.api_url, self.api_token, self.hub_timeout_seconds
            )
            targets += await self._list_workloads()
        except Exception as e:  # keep the last known servers: a hub restart is not a stop
            if not agg.hub_error:
                self.log.warning("gpulab-metrics: listing servers failed: %s", e)
            agg.hub_error = f"listing servers failed: {e}"
        else:
            if agg.hub_error:
                self.log.info("gpulab-metrics: the hub answers again")
            agg.hub_error = ""
            running = {target.key for target in targets}
            for key, state in agg.servers.items():
                if key not in running:  # stopped: a restart starts a new stretch of usage
                    self.usage.forget(state.target.user, state.target.server)
                    self.live.forget(state.target.user, state.target.server)
                    self.write_live_soon()
            agg.set_targets(targets, time.time())
        agg.expire(time.time(), self.stale_after_seconds)
        await self.write_usage()
        agg.cycles += 1
        agg.last_cycle = time.time()
        agg.last_cycle_seconds = time.monotonic() - start

    async def _list_workloads(self) -> list[Target]:
        """The job runs and Dask workers holding GPU shares; the last known ones when the hub's
        allocations cannot be read (a hub without gpulab's allocations API, or a role without
        custom:gpulab:allocations:read: servers are still listed)."""
        try:
            found = await list_workloads(
                self.http_client(), self.api_url, self.api_token, self.hub_timeout_seconds
            )
        except Exception as e:
            if not self._workloads_error:
                self.log.warning("gpulab-metrics: listing job runs and Dask workers failed: %s", e)
            self._workloads_error = str(e)
            return list(self._workloads)
        self._workloads_error = ""
        self._workloads = found
        return found

    async def write_usage(self) -> None:
        """Add the GPU-seconds used since the last cycle to the ledger (a worker thread)."""
        if not self.ledger_url:
            return
        samples = self.usage.take()
        if not samples:
            return
        try:
            ledger = await self._open_ledger()
            await asyncio.to_thread(ledger.add_usage, samples)
        except Exception as e:  # the next cycle tries again with these added
            self.usage.give_back(samples)
            self.log.warning("gpulab-metrics: writing GPU usage to the ledger failed: %s", e)

    async def _open_ledger(self) -> LedgerStore:
        async with self._ledger_opening:  # the usage and live writers may both ask first
            if self.ledger is None:
                self.ledger = await asyncio.to_thread(LedgerStore, self.ledger_url)
        return self.ledger

    def write_live_soon(self) -> None:
        """Write the slices' latest figures now, or right after the write in progress: the
        panel's figures are as old as the last push, not a listing cycle more."""
        if not self.ledger_url or (self._live_writer is not None and not self._live_writer.done()):
            return
        self._live_writer = asyncio.ensure_future(self._write_live())

    async def _write_live(self) -> None:
        while self.live.pending:
            figures, gone = self.live.take()
            try:
                ledger = await self._open_ledger()
                await asyncio.to_thread(ledger.forget_live, gone)
                await asyncio.to_thread(ledger.put_live, figures)
            except Exception as e:  # the next push tries again with these
                self.live.give_back(figures, gone)
                self.log.warning("gpulab-metrics: writing live GPU figures failed: %s", e)
                return

    async def run_loop(self) -> None:
        while True:
            start = time.monotonic()
            try:
                await self.cycle()
            except Exception:  # never let one bad cycle end the service
                self.log.exception("gpulab-metrics: listing cycle failed")
            await asyncio.sleep(
                max(0.0, self.listing_interval_seconds - (time.monotonic() - start))
            )

    async def accept_push(
        self, identity: dict[str, Any] | None, target: Target, body: bytes
    ) -> int:
        """Check, parse and record one push; returns how many series it kept. Raises PushRefused
        (nothing is recorded then)."""
        agg = self.aggregate
        authorize_push(identity, target)
        if len(body) > self.max_push_bytes:
            raise PushRefused(
                413,
                f"a push of {len(body)} bytes is over MetricsService.max_push_bytes"
                f" ({self.max_push_bytes})",
            )
        state = agg.servers.get(target.key)
        if state is None:  # started since the last listing, or not running at all: ask the hub
            check = workload_runs if target.is_workload else server_runs
            try:
                runs = await check(
                    self.http_client(),
                    self.api_url,
                    self.api_token,
                    self.hub_timeout_seconds,
                    target,
                )
            except Exception as e:
                raise PushRefused(503, f"the hub did not answer ({e}); push again later") from None
            if not runs and target.is_workload:
                raise PushRefused(
                    403, f"{target.user!r} has no job run or Dask worker {target.server!r} on a GPU"
                )
            if not runs:
                raise PushRefused(
                    403,
                    f"{target.user!r} has no running server {target.server or '(default)'!r}",
                )
        now = time.time()
        if state is not None and state.last_push is not None:
            wait = self.min_push_interval_seconds - (now - state.last_push)
            if wait > 0:
                raise PushRefused(
                    429,
                    f"pushed {now - state.last_push:.2f} s ago; at most one push per"
                    f" {self.min_push_interval_seconds:g} s (MetricsService.min_push_interval_seconds)",
                )
        try:
            text = body.decode("utf-8")
            # pure-Python parsing of up to max_push_bytes: off the event loop
            result = await asyncio.get_running_loop().run_in_executor(
                None, push_result, text, target, now, self.max_series_per_server
            )
        except (UnicodeDecodeError, ValueError) as e:
            raise PushRefused(400, f"not a Prometheus text exposition: {str(e)[:200]}") from None
        if result.dropped_series:
            self.log.warning(
                "gpulab-metrics: %s pushed more than %d series; %d dropped",
                target.key,
                self.max_series_per_server,
                result.dropped_series,
            )
        if target.key not in agg.servers:
            agg.add_target(target, now)
        agg.add_push(result)
        self.usage.observe(target.user, target.server, result.gpus)
        self.live.observe(target.user, target.server, result.gpus)
        self.write_live_soon()
        return sum(len(f.series) for f in result.families)

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
                # outside the prefix: the proxy routes only the prefix here, so pushes come
                # straight from the servers and are never seen by the proxy
                (rf"/{PUSH_PATH.strip('/')}/([^/]+)(?:/([^/]*))?", PushHandler),
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
        """Listen on $JUPYTERHUB_SERVICE_URL and list servers until the process ends."""
        url = urlparse(self.service_url)
        server = HTTPServer(self.make_app(), xheaders=True, max_body_size=4 * self.max_push_bytes)
        server.listen(url.port or 80, url.hostname or "127.0.0.1")
        self.log.info(
            "gpulab-metrics on %s%s: servers push every %.0f s to %s/%s, rules: %s",
            self.service_url,
            self.prefix,
            self.push_interval_seconds,
            self.service_url.rstrip("/"),
            PUSH_PATH.strip("/"),
            "; ".join(r.to_text() for r in self.aggregate.rules) or "none",
        )
        # The hub stops its services with SIGINT, then SIGTERM 30 s later: either ends the listing
        # loop at once. Handlers are installed explicitly because a hub started from a background
        # job passes an *ignored* SIGINT on to its services, and Python keeps it ignored.
        loop, listing = asyncio.get_running_loop(), asyncio.current_task()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._stop_on_signal, signum, listing)
        try:
            await self.run_loop()
        except asyncio.CancelledError:
            if not self.stop_signal:
                raise
            self.log.info("gpulab-metrics: stopping on %s", signal.Signals(self.stop_signal).name)
        finally:
            server.stop()
            if self.client is not None:
                self.client.close()

    stop_signal = 0

    def _stop_on_signal(self, signum: int, listing: asyncio.Task[Any] | None) -> None:
        self.stop_signal = signum
        if listing is not None:
            listing.cancel()


def main(argv: list[str] | None = None) -> None:
    # the hub stopping its services (SIGINT) is a normal end, not a traceback in its log
    with contextlib.suppress(KeyboardInterrupt):
        MetricsService.launch_instance(argv)


if __name__ == "__main__":
    main()
