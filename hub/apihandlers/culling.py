"""GPU-aware culling's REST: servers report activity, users answer warnings, admins read decisions.

    POST /hub/api/gpulab/users/{user}/[servers/{server}/]activity       a server's report
    POST /hub/api/gpulab/users/{user}/[servers/{server}/]switch-to-cpu  "Switch to CPU" now
    GET  /hub/api/gpulab/admin/culling                                  the round and decisions

Why the server pushes and the hub does not poll: the hub would need a credential that reaches
every server (the hole gpulab-metrics' push design closed), while each server already holds a
token worth only its owner's access. The report needs JupyterHub's own `users:activity` on the
owner, which a server's token holds on its owner only (`users:activity!user`, JupyterHub's
`server` role, the same scope its own POST /users/{name}/activity needs), so no server reports
for another user's servers. What a server reports is untrusted (it runs its user's code): it can
only keep its owner's servers from being culled (input, busy kernels, a keep-alive click), never
make any server culled sooner, which gives a user nothing she could not have with a busy loop
in a kernel (see gpulab.hub.cullservice.reports).

"Switch to CPU" needs `servers` on the owner (JupyterHub's scope to stop and start her servers,
also in a server's token): the same power as stopping the server and starting it on CPU herself.
"""

from __future__ import annotations

import time
from typing import Any

from jupyterhub.scopes import needs_scope
from tornado import web

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.cullservice import GPUCuller
from gpulab.hub.cullservice.reports import ReportRefused, parse_report
from gpulab.hub.scopes import ADMIN_READ
from gpulab.spawner.names import ACTIVITY_REPORT_PATH, SWITCH_TO_CPU_PATH


class _CullingHandler(GPULabAPIHandler):
    @property
    def culler(self) -> GPUCuller:
        return GPUCuller.instance(config=self.settings["config"], log=self.log)

    def running_server(self, user_name: str, server_name: str) -> tuple[str, str]:
        """(user, server) of a running server, else 404 naming it."""
        user = self.find_user(user_name)
        spawner = None
        if user is not None and server_name in user.orm_spawners:
            spawner = user.spawners[server_name]
        if spawner is None or not spawner.active:
            what = f"server {server_name!r}" if server_name else "default server"
            raise web.HTTPError(404, f"{user_name[:40]} has no running {what}")
        return (user.name, server_name)

    def refuse_unless_running(self) -> None:
        if self.culler.unavailable is not None or self.culler.parsed is None:
            raise web.HTTPError(501, self.culler.unavailable or "GPU-aware culling is not running")


class ServerActivityAPIHandler(_CullingHandler):
    """POST .../activity: the server's report (gpulab.hub.cullservice.reports) -> {"culling",
    "report_interval_seconds", "warning": null | {"deadline", "seconds_left", "action",
    "reason", "keep_alive_seconds", "switch_to_cpu"}, "keep_alive_until"}."""

    @needs_scope("users:activity")
    async def post(self, user_name: str, server_name: str = "") -> None:
        key = self.running_server(user_name, server_name)
        self.refuse_unless_running()
        now = time.time()
        try:
            report, keep_alive = parse_report(self.get_json_body(), now)
        except ReportRefused as e:
            raise web.HTTPError(400, str(e)) from None
        self.culler.receive_report(key, report, keep_alive)
        self.write(self.culler.answer_for(key, now))


class SwitchToCPUAPIHandler(_CullingHandler):
    """POST .../switch-to-cpu: restart the server on the catalog's CPU-only profile (202)."""

    @needs_scope("servers")
    async def post(self, user_name: str, server_name: str = "") -> None:
        key = self.running_server(user_name, server_name)
        self.refuse_unless_running()
        try:
            message = await self.culler.switch_to_cpu(key)
        except ValueError as e:
            raise web.HTTPError(409, str(e)) from None
        self.set_status(202)
        self.write({"message": message})


class AdminCullingAPIHandler(_CullingHandler):
    """GET /hub/api/gpulab/admin/culling: the policy, the latest round's summary ("would cull N
    servers, reclaim X GPU-h/day") and the latest decision of every running server."""

    @needs_scope(ADMIN_READ, "admin:users")
    async def get(self) -> None:
        culler = self.culler
        summary = culler.summary
        decisions = sorted(culler.decisions.values(), key=lambda d: (d.user, d.server))
        self.write(
            {
                "enabled": culler.unavailable is None,
                "unavailable": culler.unavailable,
                "dry_run": culler.parsed.dry_run if culler.parsed is not None else None,
                "check_interval_seconds": culler.check_interval_seconds,
                "checked_at": culler.checked_at,
                "policy": culler.parsed.to_dict() if culler.parsed is not None else None,
                "summary": _summary_json(summary),
                "decisions": [d.to_json() for d in decisions],
                "recent_actions": [d.to_json() for d in culler.recent_actions],
            }
        )


def _summary_json(summary: Any) -> dict[str, Any] | None:
    if summary is None:
        return None
    return {
        "text": summary.text(),
        "servers": summary.servers,
        "would_cull": summary.would_cull,
        "warned": summary.warned,
        "reclaim_gpu_hours_per_day": summary.reclaim_gpu_hours_per_day,
        "by_reason": dict(summary.by_reason),
        "dry_run": summary.dry_run,
    }


_USER = r"/api/gpulab/users/([^/]+)"
_SERVER = _USER + r"/servers/([^/]+)"

default_handlers: list[tuple[str, type[Any]]] = [
    (_USER + "/" + ACTIVITY_REPORT_PATH, ServerActivityAPIHandler),
    (_SERVER + "/" + ACTIVITY_REPORT_PATH, ServerActivityAPIHandler),
    (_USER + "/" + SWITCH_TO_CPU_PATH, SwitchToCPUAPIHandler),
    (_SERVER + "/" + SWITCH_TO_CPU_PATH, SwitchToCPUAPIHandler),
    (r"/api/gpulab/admin/culling", AdminCullingAPIHandler),
]
