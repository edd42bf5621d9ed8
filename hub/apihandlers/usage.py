"""GPU-hours: GET /hub/api/gpulab/usage (everyone's) and /hub/api/gpulab/users/{user}/usage.

Query parameters (all optional):
- since, until: ISO 8601 ("2026-12-01", "2026-12-01T08:00:00Z") or seconds since the epoch;
  default the last 30 days up to now;
- bucket: hour | day | month (UTC; default day);
- by: comma-separated, of user, group, profile, workload, gpu_model, node, tier (default user);
  empty for one row per bucket;
- format: json (default) | csv;
- user (everyone's only): only these users (repeat the parameter).

Rows hold allocated GPU-hours (fraction x hours held: four quarter shares for an hour are 1.00),
used GPU-hours (what the workload's own GPU reports said: a server's monitor, a job run's
wrapper, a Dask worker's preload; capped at allocated), idle (the monitored rest) and unmonitored
(the part of allocated held by external GPU pods, which report nothing: neither used nor idle as
far as anyone measured).

Who may: everyone's figures need `custom:gpulab:admin-read` (the GPU admin panel's scope) or
JupyterHub's admin:users; one user's need `custom:gpulab:usage` on her, which every user and her
servers' tokens hold on themselves only (`!user`), so no tenant reads another's GPU-hours.
"""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import time
from typing import Any

from jupyterhub.scopes import needs_scope
from tornado import web

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.ledger import BUCKETS, DIMENSIONS, RollupError, Row, idle_gpu_hours, rollup
from gpulab.hub.ledgerservice import GPULedger
from gpulab.hub.refusals import shown
from gpulab.hub.scopes import ADMIN_READ, USAGE

DEFAULT_DAYS = 30
#: 9999-12-31T23:59:59Z, the last second an ISO date can name
LAST_SECOND = 253402300799
#: a rollup by hour over years would be millions of rows: the span each bucket may cover
MAX_BUCKETS = 20_000


def parse_time(value: str, field: str) -> int:
    """Seconds since the epoch from ISO 8601 (UTC unless it says otherwise) or a number, within
    1970..9999."""
    expected = (
        f"{field}: expected an ISO 8601 date or time (2026-12-01, 2026-12-01T08:00:00Z) "
        f"or seconds since the epoch, from 1970 to 9999, got {shown(value)}"
    )
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise web.HTTPError(400, expected) from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.UTC)
        seconds = parsed.timestamp()
    if not 0 <= seconds <= LAST_SECOND:  # also nan and inf
        raise web.HTTPError(400, expected)
    return int(seconds)


def iso(t: int) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def running_ledger(handler: GPULabAPIHandler) -> GPULedger:
    """The hub's GPU-hour ledger; 501 saying why when it does not run."""
    ledger = GPULedger.instance(config=handler.settings["config"], log=handler.log)
    if ledger.store is None:
        raise web.HTTPError(
            501, ledger.unavailable or "the GPU-hour ledger has not started on this hub"
        )
    return ledger


class _UsageHandler(GPULabAPIHandler):
    def window(self) -> tuple[int, int, str, tuple[str, ...]]:
        now = int(time.time())
        until_arg = self.get_argument("until", "")
        until = parse_time(until_arg, "until") if until_arg else now
        since_arg = self.get_argument("since", "")
        since = parse_time(since_arg, "since") if since_arg else until - DEFAULT_DAYS * 86400
        if until <= since:
            raise web.HTTPError(400, f"until ({iso(until)}) must be after since ({iso(since)})")
        bucket = self.get_argument("bucket", "day")
        if bucket not in BUCKETS:
            raise web.HTTPError(
                400, f"bucket: expected one of {', '.join(BUCKETS)}, got {shown(bucket)}"
            )
        width = {"hour": 3600, "day": 86400, "month": 28 * 86400}[bucket]
        if (until - since) / width > MAX_BUCKETS:
            raise web.HTTPError(
                400, f"since..until spans more than {MAX_BUCKETS} {bucket}s: pick a larger bucket"
            )
        raw = self.get_argument("by", "user")
        by = tuple(d.strip() for d in raw.split(",") if d.strip())
        for d in by:
            if d not in DIMENSIONS:
                raise web.HTTPError(
                    400, f"by: expected some of {', '.join(DIMENSIONS)}, got {shown(d)}"
                )
        return since, until, bucket, by

    async def answer(self, users: set[str] | None, extra: dict[str, Any]) -> None:
        since, until, bucket, by = self.window()
        fmt = self.get_argument("format", "json")
        if fmt not in ("json", "csv"):
            raise web.HTTPError(400, f"format: expected json or csv, got {shown(fmt)}")
        ledger = running_ledger(self)
        await ledger.flush()
        store = ledger.store
        assert store is not None
        intervals = await asyncio.to_thread(store.intervals, since, until, users)
        usage = await asyncio.to_thread(store.usage, since, until, users)
        try:
            rows = rollup(intervals, usage, since=since, until=until, bucket=bucket, by=by)
        except RollupError as e:
            raise web.HTTPError(400, str(e)) from None
        if fmt == "csv":
            self.set_header("Content-Type", "text/csv; charset=utf-8")
            self.set_header("Content-Disposition", 'attachment; filename="gpu-hours.csv"')
            self.finish(to_csv(rows, by))
            return
        self.write(
            {
                "since": iso(since),
                "until": iso(until),
                "bucket": bucket,
                "by": list(by),
                "rows": [row_json(r, by) for r in rows],
                "totals": totals(rows),
                **extra,
            }
        )


def row_json(row: Row, by: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"bucket": iso(row.bucket)}
    out.update(zip(by, row.key, strict=True))
    # unrounded: a quarter GPU for 8 s is 0.000555..., and rounding would break the sums
    out["allocated_gpu_hours"] = row.allocated_gpu_hours
    out["used_gpu_hours"] = row.used_gpu_hours
    out["idle_gpu_hours"] = row.idle_gpu_hours
    # job runs' and Dask workers' hours: allocated, but neither used nor idle as far as anyone
    # measured (see gpulab.hub.ledger.MONITORED_WORKLOADS)
    out["unmonitored_gpu_hours"] = row.unmonitored_gpu_hours
    return out


def totals(rows: list[Row]) -> dict[str, float]:
    """Sums over the rows (by group, an interval counts once per group it was held for)."""
    allocated = sum(r.allocated_milli_seconds for r in rows)
    unmonitored = sum(r.unmonitored_milli_seconds for r in rows)
    used = sum(r.used_gpu_seconds for r in rows)
    return {
        "allocated_gpu_hours": allocated / 3_600_000,
        "used_gpu_hours": used / 3600,
        "idle_gpu_hours": idle_gpu_hours(allocated, unmonitored, used),
        "unmonitored_gpu_hours": unmonitored / 3_600_000,
    }


def to_csv(rows: list[Row], by: tuple[str, ...]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = [
        "bucket",
        *by,
        "allocated_gpu_hours",
        "used_gpu_hours",
        "idle_gpu_hours",
        "unmonitored_gpu_hours",
    ]
    writer.writerow(header)
    for r in rows:
        writer.writerow([row_json(r, by)[h] for h in header])
    return out.getvalue()


class UsageAPIHandler(_UsageHandler):
    """GET /hub/api/gpulab/usage: everyone's GPU-hours."""

    @needs_scope(ADMIN_READ, "admin:users")
    async def get(self) -> None:
        users = set(self.get_arguments("user")) or None
        await self.answer(users, {})


class UserUsageAPIHandler(_UsageHandler):
    """GET /hub/api/gpulab/users/{user}/usage: her GPU-hours and GPU-hour budgets."""

    @needs_scope(USAGE, "admin:users")
    async def get(self, user_name: str) -> None:
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"no user {shown(user_name)}")
        ledger = running_ledger(self)
        groups = tuple(g.name for g in user.groups)
        budgets = [b.to_json() for b in ledger.budgets_of(user.name, groups)]
        extra = {"user": user.name, "budgets": budgets}
        # the budgets' own window (the rollup's since..until is the query's)
        extra["budget_window_days"] = ledger.hour_quota_window_days
        await self.answer({user.name}, extra)


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/usage", UsageAPIHandler),
    (r"/api/gpulab/users/([^/]+)/usage", UserUsageAPIHandler),
]
