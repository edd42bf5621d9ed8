"""Pushes this server's GPU metrics to the hub's gpulab-metrics service, every push interval.

The service calls no server (a token that opened every server, sent to user code on every
scrape, was the hole this closes); each server reports for itself instead. The request carries
this server's own $JUPYTERHUB_API_TOKEN: it is worth no more than its user's access to this one
server (JupyterHub's `server` role: access:servers!server=<user>/<name>, users:activity!user),
and the service asks the hub whose it is and forces the labels `user` and `server` to that, so
another tenant can neither use it nor report through it for anyone but its owner. A user who
points $GPULAB_METRICS_PUSH_URL elsewhere only hands her own server's token to herself.

The push goes straight to the service's own address, never through the proxy, so it is no
activity of this server's and idle culling still applies. Every request has a timeout and runs on
the loop's non-blocking HTTP client; failures are logged once per outage, not every period.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from gpulab.spawner.names import DEFAULT_PUSH_INTERVAL_SECONDS, PUSH_INTERVAL_ENV, PUSH_URL_ENV

log = logging.getLogger(__name__)

__all__ = ["PUSH_INTERVAL_ENV", "PUSH_URL_ENV", "MetricsPusher", "push_settings_from_env"]


def push_settings_from_env(env: Mapping[str, str] | None = None) -> tuple[str, float]:
    """The push URL ("" when the hub runs no gpulab-metrics service) and interval (seconds)."""
    env = os.environ if env is None else env
    raw = env.get(PUSH_INTERVAL_ENV, "").strip()
    try:
        interval = float(raw) if raw else DEFAULT_PUSH_INTERVAL_SECONDS
    except ValueError:
        raise ValueError(
            f"{PUSH_INTERVAL_ENV}={raw!r} is not a number; the hub sets e.g. {PUSH_INTERVAL_ENV}=15"
        ) from None
    if not interval > 0:
        raise ValueError(f"{PUSH_INTERVAL_ENV}={raw!r} must be more than 0 seconds")
    return env.get(PUSH_URL_ENV, "").strip(), interval


class MetricsPusher:
    """POSTs `body()` (Prometheus text) to <url>/<user>[/<server>] every `interval_seconds`."""

    def __init__(
        self,
        url: str,
        token: str,
        user: str,
        server: str,
        body: Callable[[], bytes],
        interval_seconds: float,
        timeout_seconds: float | None = None,
    ) -> None:
        path = quote(user, safe="") + (f"/{quote(server, safe='')}" if server else "")
        self.url = f"{url.rstrip('/')}/{path}"
        self.token = token
        self.body = body
        self.interval_seconds = interval_seconds
        # a push that takes longer than its period would only pile up behind the next one
        self.timeout_seconds = timeout_seconds or min(10.0, interval_seconds)
        self.client: AsyncHTTPClient | None = None
        self.task: asyncio.Task[None] | None = None
        self.pushes = 0
        self.failures = 0
        self.error = ""  # the current outage's first error; "" while pushes are accepted
        self.last_push: float | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.client = AsyncHTTPClient(force_instance=True)
        self.task = loop.create_task(self.run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        if self.client is not None:
            self.client.close()
            self.client = None

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.push_once()
            await asyncio.sleep(max(0.0, self.interval_seconds - (time.monotonic() - started)))

    async def push_once(self) -> bool:
        """One push; never raises. True when the service accepted it."""
        try:
            error = await self._push()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # DNS, refused connection, timeout, a broken body...
            error = f"{type(e).__name__}: {e}"
        if error:
            self.failures += 1
            if not self.error:  # once per outage
                log.warning(
                    "gpulab monitor: pushing GPU metrics to %s failed: %s (retrying every %g s;"
                    " logged again only after it works)",
                    self.url,
                    error,
                    self.interval_seconds,
                )
            self.error = error
            return False
        if self.error:
            log.info("gpulab monitor: pushing GPU metrics to %s works again", self.url)
        self.error, self.last_push = "", time.time()
        self.pushes += 1
        return True

    async def _push(self) -> str:
        client = self.client or AsyncHTTPClient()
        response = await client.fetch(
            HTTPRequest(
                self.url,
                method="POST",
                body=self.body(),
                headers={
                    "Authorization": f"token {self.token}",
                    "Content-Type": "text/plain; version=0.0.4",
                },
                connect_timeout=self.timeout_seconds,
                request_timeout=self.timeout_seconds,
                follow_redirects=False,  # the token goes to the configured address only
            ),
            raise_error=False,
        )
        if response.code == 599:
            return f"no answer: {response.error}"
        if response.code >= 300:
            text = response.body.decode(errors="replace")[:300] if response.body else ""
            return f"HTTP {response.code} {text or response.reason}"
        return ""
