"""Scraping for the gpulab-metrics service: which servers run (hub API), and their figures.

Each running server's monitor (jupyterlab-gpulab, GET <server url>gpulab/monitor/metrics) is
read with the service's token at the server's own address, the proxy route's target (hub API
GET /proxy), not through the proxy: the proxy counts every answered request as activity, and
scrapes every 15 s would keep idle servers from ever being culled. The labels `user` and
`server` of what comes back are the hub's, never the server's own: a user's server is user
code and must not be able to report figures, or raise alerts, for another user.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlparse

from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from gpulab.hub.alerts import Sample

log = logging.getLogger("gpulab.metrics")

MIB = 1024.0 * 1024.0
MONITOR_PATH = "gpulab/monitor/metrics"
# names this service exports itself: a scraped server may not shadow them
RESERVED_PREFIXES = ("gpulab_scrape_", "gpulab_metrics_", "gpulab_hub_")
PAGINATION = "application/jupyterhub-pagination+json"


@dataclass(frozen=True)
class Target:
    """One running server, as the hub lists it."""

    user: str
    server: str  # "" for the default server
    url: str  # the monitor's metrics URL at the server's own address ("" if not routed)

    @property
    def key(self) -> str:
        return f"{self.user}/{self.server}"


@dataclass(frozen=True)
class Series:
    """One scraped sample: metric name, labels (user/server set by the hub), value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass
class Family:
    name: str
    documentation: str
    type: str
    series: list[Series] = field(default_factory=list)


@dataclass
class ScrapeResult:
    target: Target
    t: float  # time.time() when the answer came
    duration_seconds: float
    ok: bool
    error: str = ""
    families: list[Family] = field(default_factory=list)
    gpus: dict[str, Sample] = field(default_factory=dict)  # gpu uuid -> figures
    dropped_series: int = 0


def targets_from_users(
    users: Iterable[dict[str, Any]], routes: dict[str, dict[str, Any]]
) -> list[Target]:
    """Ready servers of the hub API's user models (GET /users?state=active), each at the target
    of its proxy route (GET /proxy); url "" when the proxy has no route for it (yet)."""
    where = {}
    for route in routes.values():
        data = route.get("data") or {}
        if "user" in data and route.get("target"):
            where[(str(data["user"]), str(data.get("server_name", "")))] = str(route["target"])
    out = []
    for user in users:
        for name, server in (user.get("servers") or {}).items():
            if not server.get("ready") or not server.get("url"):
                continue
            path = urlparse(str(server["url"])).path
            if not path.endswith("/"):
                path += "/"
            host = where.get((str(user["name"]), str(name)))
            url = f"{host.rstrip('/')}{path}{MONITOR_PATH}" if host else ""
            out.append(Target(str(user["name"]), str(name), url))
    return sorted(out, key=lambda t: (t.user, t.server))


async def _get_paginated(
    client: AsyncHTTPClient, url: str, token: str, timeout_seconds: float, page_size: int
) -> list[Any]:
    """Every page of a hub API listing: its items (a list, or a dict's (key, value) pairs)."""
    out: list[Any] = []
    offset = 0
    while True:
        query = urlencode({"offset": offset, "limit": page_size})
        response = await client.fetch(
            HTTPRequest(
                f"{url}{'&' if '?' in url else '?'}{query}",
                headers={"Authorization": f"token {token}", "Accept": PAGINATION},
                connect_timeout=timeout_seconds,
                request_timeout=timeout_seconds,
            ),
            raise_error=False,
        )
        if response.code != 200:
            body = response.body.decode(errors="replace")[:300] if response.body else ""
            raise RuntimeError(
                f"GET {url} answered {response.code} {body or response.reason} (the gpulab-metrics"
                " role needs list:users, read:users, read:servers, access:servers and proxy)"
            )
        page = json.loads(response.body)
        if not isinstance(page, dict) or "items" not in page:  # a hub without pagination
            return list(page.items()) if isinstance(page, dict) else list(page)
        items = page["items"]
        items = list(items.items()) if isinstance(items, dict) else list(items)
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
    """Every ready server and where it listens. Raises on hub errors."""
    base = api_url.rstrip("/")
    users = await _get_paginated(
        client, f"{base}/users?state=active", token, timeout_seconds, page_size
    )
    routes = await _get_paginated(client, f"{base}/proxy", token, timeout_seconds, page_size)
    return targets_from_users(users, dict(routes))


def parse_exposition(
    text: str, target: Target, max_series: int = 1000
) -> tuple[list[Family], dict[str, Sample], int]:
    """Families of gpulab_ metrics (labels user/server forced to the target's), figures per GPU,
    and how many series were dropped over max_series. ValueError when the text is not an
    exposition."""
    families: list[Family] = []
    kept = dropped = 0
    figures: dict[str, dict[str, float]] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for mf in text_string_to_metric_families(text):
        if not mf.name.startswith("gpulab_") or mf.name.startswith(RESERVED_PREFIXES):
            continue
        family = Family(mf.name, mf.documentation, mf.type)
        for s in mf.samples:
            if kept >= max_series:
                dropped += 1
                continue
            if not math.isfinite(s.value):
                continue
            labels = {k: v for k, v in s.labels.items() if k not in ("user", "server")}
            labels["user"], labels["server"] = target.user, target.server
            identity = (s.name, tuple(sorted(labels.items())))
            if identity in seen:
                continue
            seen.add(identity)
            family.series.append(Series(s.name, identity[1], float(s.value)))
            kept += 1
            gpu = labels.get("gpu", "")
            if gpu and s.name in _FIGURES:
                figures.setdefault(gpu, {})[_FIGURES[s.name][0]] = s.value * _FIGURES[s.name][1]
        if family.series:
            families.append(family)
    return families, {gpu: Sample(0.0, **f) for gpu, f in figures.items()}, dropped


_FIGURES: dict[str, tuple[str, float]] = {
    "gpulab_gpu_utilization_ratio": ("utilization_pct", 100.0),
    "gpulab_gpu_memory_used_bytes": ("memory_used_mib", 1 / MIB),
    "gpulab_gpu_memory_limit_bytes": ("memory_limit_mib", 1 / MIB),
    "gpulab_gpu_temperature_celsius": ("temperature_c", 1.0),
    "gpulab_gpu_power_watts": ("power_w", 1.0),
}


async def scrape(
    client: AsyncHTTPClient,
    target: Target,
    token: str,
    timeout_seconds: float,
    max_series: int = 1000,
) -> ScrapeResult:
    """Read one server's metrics; never raises (a failure is a result with ok=False)."""
    start = time.monotonic()

    def failed(error: str) -> ScrapeResult:
        return ScrapeResult(target, time.time(), time.monotonic() - start, False, error)

    if not target.url:
        return failed("the hub lists the server as ready but the proxy has no route to it")

    try:
        response = await client.fetch(
            HTTPRequest(
                target.url,
                headers={"Authorization": f"token {token}", "Accept": "text/plain"},
                connect_timeout=timeout_seconds,
                request_timeout=timeout_seconds,
                follow_redirects=False,
            ),
            raise_error=False,
        )
    except Exception as e:  # DNS, refused connection, TLS...
        return failed(f"{type(e).__name__}: {e}")
    if response.code == 599:
        return failed(f"no answer from {target.url}: {response.error}")
    if response.code in (301, 302, 303, 307, 308, 401, 403):
        return failed(
            f"HTTP {response.code}: the server refused the service token"
            " (the gpulab-metrics role needs access:servers)"
        )
    if response.code == 404:
        return failed(
            f"HTTP 404: no GPU monitor at {target.url}"
            " (is jupyterlab-gpulab installed in the server's environment?)"
        )
    if response.code != 200:
        return failed(f"HTTP {response.code} {response.reason}")
    try:
        text = response.body.decode("utf-8")
        # pure-Python parsing of up to max_body_size: off the event loop
        families, gpus, dropped = await asyncio.get_running_loop().run_in_executor(
            None, parse_exposition, text, target, max_series
        )
    except (ValueError, UnicodeDecodeError, IndexError, KeyError, TypeError) as e:
        return failed(f"not a Prometheus text exposition: {e}")
    t = time.time()
    stamped = {gpu: Sample(t, *_fields(s)) for gpu, s in gpus.items()}
    if dropped:
        log.warning(
            "gpulab-metrics: %s exported more than %d series; %d dropped",
            target.key,
            max_series,
            dropped,
        )
    return ScrapeResult(target, t, time.monotonic() - start, True, "", families, stamped, dropped)


def _fields(s: Sample) -> tuple[float | None, ...]:
    return (s.utilization_pct, s.memory_used_mib, s.memory_limit_mib, s.temperature_c, s.power_w)
