"""The hub's proxy: JupyterHub's configurable-http-proxy with a route of its own for each server's
VS Code, so that an open but untouched VS Code tab is not activity.

configurable-http-proxy records every frame a browser sends through a route as that route's
activity, and JupyterHub copies the activity of every route whose data names a user into her
server's `last_activity` (`JupyterHub.update_last_activity`). VS Code's workbench sends a
keep-alive every few seconds and background calls every second, so through the server's own
route an open tab would keep the server from ever being culled (nebari#1902).

`GPULabProxy` therefore adds, beside each server's route `/user/<name>/[<server>/]`, the route
`.../vscode/` to the same target, whose data names no user (`VSCODE_ROUTE_KEY` instead): the
proxy still routes it (the longest prefix wins) and JupyterHub does not count its traffic. The
server itself counts only a person's input there (jupyterlab_gpulab.vscode) and reports it to
the hub like its other activity. Authentication is unchanged: the route ends at the same user
server, behind its own OAuth.

`apply(c)` makes it the hub's proxy unless an admin chose one (`JupyterHub.proxy_class`); with
another proxy VS Code's traffic counts as activity again.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jupyterhub.proxy import ConfigurableHTTPProxy
from jupyterhub.utils import url_escape_path, url_path_join

#: the path of VS Code below a server's prefix (jupyter-server-proxy's route in the server)
VSCODE_PATH = "vscode/"
#: the key of a VS Code route's data ("<user>/<server>"); no "user" key, so no activity
VSCODE_ROUTE_KEY = "gpulab_vscode"


def vscode_routespec(server_routespec: str) -> str:
    return url_path_join(server_routespec, VSCODE_PATH)


class GPULabProxy(ConfigurableHTTPProxy):
    """configurable-http-proxy with an activity-free route for each server's VS Code."""

    async def add_user(self, user: Any, server_name: str = "") -> None:
        await super().add_user(user, server_name)
        spawner = user.spawners[server_name]
        await self.add_route(
            vscode_routespec(spawner.proxy_spec),
            spawner.server.host,
            {VSCODE_ROUTE_KEY: f"{user.name}/{server_name}"},
        )

    async def delete_user(self, user: Any, server_name: str = "") -> None:
        await super().delete_user(user, server_name)
        routespec = user.proxy_spec
        if server_name:  # as JupyterHub's own delete_user names it
            routespec = url_path_join(user.proxy_spec, url_escape_path(server_name), "/")
        await self.delete_route(vscode_routespec(routespec))

    async def check_routes(
        self, user_dict: Any, service_dict: Any, routes: dict[str, Any] | None = None
    ) -> None:
        """JupyterHub's check without the VS Code routes (it would delete them as stale), then
        theirs: one per ready server, to its current target; none left for a stopped one."""
        if not routes:
            routes = await self.get_all_routes()
        ours = {spec: r for spec, r in routes.items() if VSCODE_ROUTE_KEY in r["data"]}
        await super().check_routes(
            user_dict, service_dict, {s: r for s, r in routes.items() if s not in ours}
        )
        wanted: dict[str, tuple[str, str]] = {}
        keep: set[str] = set()
        for user in user_dict.values():
            for name, spawner in user.spawners.items():
                spec = vscode_routespec(spawner.proxy_spec)
                if spawner.ready:
                    wanted[spec] = (spawner.server.host, f"{user.name}/{name}")
                elif spawner.pending:  # as JupyterHub does: not stale while pending
                    keep.add(spec)
        futures = [
            self.add_route(spec, target, {VSCODE_ROUTE_KEY: label})
            for spec, (target, label) in wanted.items()
            if spec not in ours or ours[spec]["target"] != target
        ]
        for spec in ours:
            if spec not in wanted and spec not in keep:
                self.log.info("Deleting stale VS Code route %s", spec)
                futures.append(self.delete_route(spec))
        await asyncio.gather(*futures)
