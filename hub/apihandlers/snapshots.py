"""Workspace snapshots of a user's servers: list and take them, restore a stopped server's home,
clone one into a new named server.

    GET/POST /hub/api/gpulab/users/{user}/[servers/{server}/]snapshots
    POST     .../snapshots/{id}/restore
    POST     .../snapshots/{id}/clone  {"name": "new-server"}

Who may (JupyterHub's scopes `read:servers` and `servers` on the owner: the owner, admins, any
role that grants them) and what each action does are in
`gpulab.hub.apihandlers.workspace_actions`, shared with the workspaces page.
"""

from __future__ import annotations

from typing import Any

from tornado import web

from gpulab.hub.apihandlers import workspace_actions
from gpulab.hub.apihandlers.base import GPULabAPIHandler


class _WorkspaceHandler(GPULabAPIHandler):
    def _spawner_for(
        self, username: str, server: str, scope: str = workspace_actions.CHANGE
    ) -> Any:
        return workspace_actions.workspace_spawner(self, username, server, scope)


class WorkspaceSnapshotsAPIHandler(_WorkspaceHandler):
    """GET /hub/api/gpulab/users/{user}/[servers/{server}/]snapshots: newest first, with the
    kernel checkpoints a start would offer; POST: take one now."""

    async def get(self, username: str, server: str = "") -> None:
        spawner = self._spawner_for(username, server, workspace_actions.READ)
        offer = await spawner.workspace_offer()
        kernels = offer["kernels"] if offer else []
        self.write({"snapshots": await spawner.list_workspace_snapshots(), "kernels": kernels})

    async def post(self, username: str, server: str = "") -> None:
        """A snapshot now, label 'on-demand' (the server may be running)."""
        spawner = self._spawner_for(username, server)
        self.set_status(201)
        self.write(await workspace_actions.take_snapshot(spawner))


def _server_and_snapshot(rest: tuple[str, ...]) -> tuple[str, str]:
    return (rest[0], rest[1]) if len(rest) == 2 else ("", rest[0])


class WorkspaceRestoreAPIHandler(_WorkspaceHandler):
    """POST .../snapshots/{id}/restore: the stopped server's home goes back to that snapshot."""

    async def post(self, username: str, *rest: str) -> None:
        server, snapshot_id = _server_and_snapshot(rest)
        spawner = self._spawner_for(username, server)
        self.write(await workspace_actions.restore(self, spawner, snapshot_id))


class WorkspaceCloneAPIHandler(_WorkspaceHandler):
    """POST .../snapshots/{id}/clone {"name": "new-server"}: a new named server whose home
    starts as that snapshot (kernel checkpoints included); start it as usual."""

    async def post(self, username: str, *rest: str) -> None:
        server, snapshot_id = _server_and_snapshot(rest)
        spawner = self._spawner_for(username, server)
        body = self.get_json_body() or {}
        if not isinstance(body, dict):
            raise web.HTTPError(400, 'The body must be a JSON object like {"name": "exp-2"}')
        result = await workspace_actions.clone(self, spawner, snapshot_id, body.get("name"))
        self.set_status(201)
        self.write(result)


_USER = r"/api/gpulab/users/([^/]+)"
_SERVER = _USER + r"/servers/([^/]+)"

default_handlers: list[tuple[str, type[Any]]] = [
    (_USER + r"/snapshots", WorkspaceSnapshotsAPIHandler),
    (_SERVER + r"/snapshots", WorkspaceSnapshotsAPIHandler),
    (_USER + r"/snapshots/([^/]+)/restore", WorkspaceRestoreAPIHandler),
    (_SERVER + r"/snapshots/([^/]+)/restore", WorkspaceRestoreAPIHandler),
    (_USER + r"/snapshots/([^/]+)/clone", WorkspaceCloneAPIHandler),
    (_SERVER + r"/snapshots/([^/]+)/clone", WorkspaceCloneAPIHandler),
]
