"""The GPU admin panel's GPU-hour budgets: GET /hub/api/gpulab/admin/budgets.

Every configured budget (`GPULedger.hour_quota_users` and `hour_quota_groups`) with its limit,
the GPU-hours allocated against it in the rolling window, what is left, its state (ok, warn at
`hour_quota_warn_percent`, exhausted) and its burn-down: GPU-hours left at each day of the
window. A user's budget counts her own intervals, a group's every interval held for that group
(an interval carries its owner's groups at grant time), as the launch check counts them.

The figures are computed from the ledger at the call, not from the budget check's periodic
copy, so a budget's last burn-down point is its `remaining_gpu_hours`.

Who may: `custom:gpulab:admin-read` (the panel's scope) or JupyterHub's admin:users, as the
panel's overview.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from jupyterhub.scopes import needs_scope
from tornado import web

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.apihandlers.usage import iso, running_ledger
from gpulab.hub.ledger import HourQuota, Interval, burn_down
from gpulab.hub.ledger.quota import EXHAUSTED, OK, WARN, allocated_milli_seconds, every_budget
from gpulab.hub.refusals import shown
from gpulab.hub.scopes import ADMIN_READ

STATES = (OK, WARN, EXHAUSTED)
#: the burn-down's step: a point per day (a window shorter than a day still gets its two ends)
BURN_DOWN_STEP_SECONDS = 86400


def counts_towards(interval: Interval, scope: str, name: str) -> bool:
    """Whether `interval` is spent from the budget of user or group `name`."""
    if scope == "user":
        return interval.holding.user == name
    return name in interval.holding.groups


def budgets_with_burn_down(
    quota: HourQuota, intervals: Iterable[Interval], since: int, until: int
) -> list[dict[str, Any]]:
    """Each configured budget's standing and burn-down over [since, until]: users' first, then
    groups', each by name."""
    chosen = list(intervals)
    by_user, by_group = allocated_milli_seconds(chosen, since, until)
    out = []
    for budget in every_budget(quota, by_user, by_group):
        scope, name, limit = budget.scope, budget.name, budget.limit_gpu_hours
        counted = [i for i in chosen if counts_towards(i, scope, name)]
        points = burn_down(counted, limit, since, until, BURN_DOWN_STEP_SECONDS)
        out.append(
            {
                **budget.to_json(),
                "users": sorted({i.holding.user for i in counted}),
                "burn_down": [
                    {"t": iso(t), "remaining_gpu_hours": round(left, 6)} for t, left in points
                ],
            }
        )
    return out


def parse_states(raw: str) -> set[str]:
    """?state=warn,exhausted -> the states asked for (all when empty); 400 naming a bad one."""
    asked = {s.strip() for s in raw.split(",") if s.strip()}
    for state in asked:
        if state not in STATES:
            raise web.HTTPError(
                400, f"state: expected some of {', '.join(STATES)}, got {shown(state)}"
            )
    return asked or set(STATES)


class AdminBudgetsAPIHandler(GPULabAPIHandler):
    """GET /hub/api/gpulab/admin/budgets[?state=warn,exhausted]: {"generated_at", "window",
    "budgets"} (see the module docstring)."""

    @needs_scope(ADMIN_READ, "admin:users")
    async def get(self) -> None:
        states = parse_states(self.get_argument("state", ""))
        ledger = running_ledger(self)
        await ledger.flush()
        quota = ledger.quota
        until = int(time.time())
        since = until - quota.window_seconds
        budgets: list[dict[str, Any]] = []
        if quota:
            intervals = await asyncio.to_thread(ledger.store.intervals, since, until)
            # one pass per budget over the window's intervals: off the event loop
            budgets = await asyncio.to_thread(
                budgets_with_burn_down, quota, intervals, since, until
            )
        self.write(
            {
                "generated_at": iso(until),
                "window": {
                    "since": iso(since),
                    "until": iso(until),
                    "days": ledger.hour_quota_window_days,
                    "warn_percent": ledger.hour_quota_warn_percent,
                },
                "budgets": [b for b in budgets if b["state"] in states],
            }
        )


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/admin/budgets", AdminBudgetsAPIHandler),
]
