"""The hub page where users see their servers' snapshots and restore or clone them.

Plain HTML forms posting back to the page (with JupyterHub's xsrf token), so it works without
JavaScript; the same actions are in the REST API (`/hub/api/gpulab/users/{user}/...`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from jupyterhub.handlers.base import BaseHandler
from tornado import web

from gpulab.hub.apihandlers import workspace_actions
from gpulab.hub.refusals import check_body_size, shown
from gpulab.hub.workspaces import keeps_workspaces
from gpulab.spawner.picker import snapshot_time

#: the page's template, in hub/templates
TEMPLATE = "gpulab-workspaces.html"


class WorkspacesPageHandler(BaseHandler):
    """GET/POST /hub/gpulab/workspaces[?user=NAME]: snapshots of the caller's servers (an admin
    may look at another user's)."""

    async def prepare(self) -> None:
        if self.request.method == "POST":
            check_body_size(self)
        await super().prepare()

    def _owner(self) -> str:
        user = self.current_user
        if user is None:
            raise web.HTTPError(403, "Authentication required")
        return self.get_argument("user", user.name)

    async def _render(self, owner: str, done: str = "", error: str = "") -> str:
        default = workspace_actions.workspace_spawner(self, owner, "", workspace_actions.READ)
        servers = []
        for name in sorted(default.user.orm_spawners):
            spawner = default.user.spawners[name]
            if not keeps_workspaces(spawner):
                continue
            offer = await spawner.workspace_offer()
            sharing = workspace_actions.servers_using_home(
                default.user, workspace_actions.home_of(spawner)
            )
            servers.append(
                {
                    "name": name,
                    "active": spawner.active,
                    "busy": workspace_actions.running_label([s for s in sharing if s.active]),
                    "snapshots": await spawner.list_workspace_snapshots(),
                    "kernels": (offer or {}).get("kernels", []),
                }
            )
        env = self.settings["jinja2_env_sync"]
        if "snapshot_time" not in env.filters:
            env.filters["snapshot_time"] = snapshot_time
        # hub/templates is on JupyterHub's template path (gpulab.hub.config.apply)
        page = self.render_template(
            TEMPLATE, sync=True, owner=owner, servers=servers, done=done, error=error
        )
        return str(page)

    @web.authenticated
    async def get(self) -> None:
        owner = self._owner()
        self.write(
            await self._render(
                owner, done=self.get_argument("done", ""), error=self.get_argument("error", "")
            )
        )

    @web.authenticated
    async def post(self) -> None:
        owner = self._owner()
        action = self.get_body_argument("action", "")
        server = self.get_body_argument("server", "")
        snapshot_id = self.get_body_argument("snapshot", "")
        query: dict[str, str] = {"user": owner} if owner != self.current_user.name else {}
        try:
            spawner = workspace_actions.workspace_spawner(
                self, owner, server, workspace_actions.CHANGE
            )
            label = server or "default server"
            if action == "restore":
                await workspace_actions.restore(self, spawner, snapshot_id)
                query["done"] = f"Restored {label} to its snapshot of {snapshot_id}."
            elif action == "snapshot":
                await workspace_actions.take_snapshot(spawner)
                query["done"] = f"Took a snapshot of {label}."
            elif action == "clone":
                new_name = self.get_body_argument("name", "").strip()
                await workspace_actions.clone(self, spawner, snapshot_id, new_name)
                query["done"] = f"Cloned {label} into new server {new_name!r}: start it below."
            else:
                raise web.HTTPError(
                    400, f"Unknown action {shown(action)}: snapshot, restore or clone"
                )
        except web.HTTPError as e:
            if e.status_code == 403:
                raise
            self.set_status(e.status_code)
            self.write(await self._render(owner, error=e.get_message() or str(e)))
            return
        self.redirect(f"{self.hub.base_url}gpulab/workspaces?{urlencode(query)}")


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/gpulab/workspaces", WorkspacesPageHandler),
]
