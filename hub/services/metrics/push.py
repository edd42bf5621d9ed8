"""What a server's push to gpulab-metrics is, and who may make it.

Each server's GPU monitor POSTs its Prometheus exposition to the service with the server's own
JUPYTERHUB_API_TOKEN (jupyterlab_gpulab/push.py). That token is worth no more than its user's
access to that one server, so handing it to the service costs nothing; the service, which used
to call every server with a token that opened them all, now calls none.

A server is user code: what it sends is untrusted. The labels `user` and `server` of every
series are the ones the hub vouches for (the token's owner, and a server of hers that runs),
never the page's own, so a user can only ever report figures, or raise alerts, for her own
servers.

A job run or a Dask worker pushes the same way for `<user>/<workload name>` ("job-17",
"dask-3-w2"), with the report token the hub issued it (gpulab.hub.report_tokens): its owner's,
holding `custom:gpulab:report-gpu!server=<user>/<workload name>` and nothing else. A server's
token cannot report for a workload, nor a workload's token for a server or another workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from jupyterhub.services.auth import check_scopes
from prometheus_client.parser import text_string_to_metric_families

from gpulab.hub.alerts import Sample
from gpulab.hub.services.metrics.listing import Target
from gpulab.spawner.names import REPORT_GPU_SCOPE

MIB = 1024.0 * 1024.0
# names this service exports itself: a server may not shadow them
RESERVED_PREFIXES = ("gpulab_scrape_", "gpulab_push_", "gpulab_metrics_", "gpulab_hub_")


@dataclass(frozen=True)
class Series:
    """One pushed sample: metric name, labels (user/server set by the hub), value."""

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
class PushResult:
    """One accepted push: its families and its figures per GPU."""

    target: Target
    t: float  # time.time() when it arrived
    families: list[Family] = field(default_factory=list)
    gpus: dict[str, Sample] = field(default_factory=dict)  # gpu uuid -> figures
    dropped_series: int = 0


class PushRefused(Exception):
    """A push the service refuses: HTTP status and a sentence saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def authorize_push(identity: dict[str, Any] | None, target: Target) -> None:
    """Raise PushRefused unless the hub identity (HubAuth's model of the push's token) may report
    for `target`: it is a user's token, that user owns the target, and its scopes reach that
    server (a server's own token holds access:servers!server=<user>/<name> for itself only).
    Whether the target runs is the caller's check."""
    if not identity:
        raise PushRefused(403, "the push's token is not a valid hub token")
    owner, kind = str(identity.get("name", "")), identity.get("kind", "user")
    if kind != "user":
        raise PushRefused(403, f"{kind} {owner!r} has no server: only servers push their figures")
    what = "a job run or Dask worker" if target.is_workload else "a server"
    if owner != target.user:
        raise PushRefused(403, f"a token of {owner!r} cannot report for {what} of {target.user!r}")
    if target.is_workload:
        scope = f"{REPORT_GPU_SCOPE}!server={target.user}/{target.server}"
        if not check_scopes({scope}, set(identity.get("scopes") or [])):
            raise PushRefused(
                403,
                f"this token of {owner!r} is not {target.server!r}'s report token (it lacks"
                f" {scope})",
            )
        return
    scope = f"access:servers!server={target.user}/{target.server}"
    if not check_scopes({scope}, set(identity.get("scopes") or [])):
        raise PushRefused(
            403,
            f"this token of {owner!r} does not reach server {target.server or '(default)'!r}"
            f" (it lacks {scope})",
        )


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


def push_result(text: str, target: Target, t: float, max_series: int = 1000) -> PushResult:
    """A push's body as figures stamped `t` (pure; run off the event loop: a body is up to
    MetricsService.max_push_bytes of pure-Python parsing). ValueError when it is no exposition."""
    try:
        families, gpus, dropped = parse_exposition(text, target, max_series)
    except (IndexError, KeyError, TypeError) as e:  # the parser's ways of saying "not text format"
        raise ValueError(str(e)) from None
    stamped = {gpu: replace(sample, t=t) for gpu, sample in gpus.items()}
    return PushResult(target, t, families, stamped, dropped)
