"""GET <base_url>gpulab/budget: the GPU-hours this server's owner has left, for the lab's job form
and GPU panel.

The page holds no hub token (see `jobs_handlers`), so this server asks the hub's
/hub/api/gpulab/users/<owner>/usage with its own $JUPYTERHUB_API_TOKEN, which holds
`custom:gpulab:usage!user`: her own figures and nobody else's. The owner is this server's
$JUPYTERHUB_USER; the request names no user, so whoever reaches this server reads its owner's
budget only.

    {"budget": null}                          no budget binds her (the lab shows nothing)
    {"budget": {"scope", "name", "limit_gpu_hours", "allocated_gpu_hours",
                "remaining_gpu_hours", "state", "window_days"},
     "line": "GPU-hours left: 12.5 of 100 (30 days)"}

The budget is the tightest of hers and her groups' (the least left), the one that decides
whether a GPU start is refused.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .hubjobs import HubError, HubJobs, HubUnavailable

ROUTE = "gpulab/budget"


def tightest(budgets: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The budget with the least left (the user's own first on a tie, as the hub decides)."""
    return min(
        budgets,
        key=lambda b: (float(b["remaining_gpu_hours"]), b.get("scope") != "user"),
        default=None,
    )


def budget_line(budget: dict[str, Any], window_days: float) -> str:
    """'GPU-hours left: 12.5 of 100 (30 days)'; a group's budget names the group."""
    where = f"{window_days:g} days"
    if budget.get("scope") == "group":
        where += f", group {budget['name']}"
    return (
        f"GPU-hours left: {float(budget['remaining_gpu_hours']):.1f} of "
        f"{float(budget['limit_gpu_hours']):g} ({where})"
    )


def budget_reply(usage: dict[str, Any]) -> dict[str, Any]:
    """This handler's answer from the hub's users/<owner>/usage answer."""
    found = tightest(list(usage.get("budgets") or []))
    if found is None:
        return {"budget": None, "line": None}
    window_days = float(usage.get("budget_window_days") or 30)
    return {
        "budget": {**found, "window_days": window_days},
        "line": budget_line(found, window_days),
    }


class BudgetHandler(APIHandler):
    # reading one's budget is not using the server: idle culling still applies
    _track_activity = False

    @web.authenticated
    async def get(self) -> None:
        try:
            hub = HubJobs.from_env()
        except HubUnavailable as e:
            raise web.HTTPError(501, str(e)) from None
        # one row per month of the default window: the budgets are what is wanted, not the rollup
        url = f"{hub.api_url}/gpulab/users/{quote(hub.user, safe='')}/usage?by=&bucket=month"
        try:
            usage = await hub.call("GET", url)
        except HubError as e:
            raise web.HTTPError(e.status if 400 <= e.status < 600 else 502, e.message) from None
        self.finish(json.dumps(budget_reply(dict(usage))))


def setup_budget_handlers(web_app: Any) -> None:
    route = url_path_join(web_app.settings["base_url"], ROUTE)
    web_app.add_handlers(".*$", [(route, BudgetHandler)])
