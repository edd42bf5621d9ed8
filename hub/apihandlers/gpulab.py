"""Hub REST endpoints of gpulab: live capacity per profile, and allocations for admins.

Register them with `c.JupyterHub.extra_handlers = gpulab_handlers` when not using gpulab's
authenticator (which adds them itself). gpulab's checks in front of JupyterHub's own server
handlers (`gpulab.hub.handlers.servers`) cannot go there: extra handlers come after JupyterHub's,
so another authenticator must return `server_handler_overrides` first from its get_handlers.

Every body is capped at 64 KiB (413) before it is parsed; values echoed in errors are shortened.
"""

from __future__ import annotations

from typing import Any

from jupyterhub.apihandlers.base import APIHandler
from tornado import web

from gpulab.hub.apihandlers import workspace_actions
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.handlers.workspaces import WorkspacesPageHandler
from gpulab.hub.refusals import check_body_size


class _GPULabAPIHandler(APIHandler):
    async def prepare(self) -> None:
        # before authentication and parsing: an oversized body costs nothing more than reading it
        check_body_size(self)
        await super().prepare()

    @property
    def gpu_capacity(self) -> GPUCapacity:
        return GPUCapacity.instance(config=self.settings["config"], log=self.log)

    def _caller_groups_admin(self) -> tuple[str, frozenset[str], bool]:
        caller = self.current_user
        if caller is None:
            raise web.HTTPError(403, "Authentication required")
        groups = frozenset(g.name for g in getattr(caller, "groups", []) or [])
        is_admin = bool(getattr(caller, "admin", False)) or "admin:users" in self.expanded_scopes
        return caller.name, groups, is_admin


class CapacityAPIHandler(_GPULabAPIHandler):
    """GET /hub/api/gpulab/capacity: the caller's profiles with free and waiting counts."""

    async def get(self) -> None:
        name, groups, is_admin = self._caller_groups_admin()
        capacity = self.gpu_capacity
        await capacity.ready()
        profiles = []
        for profile in capacity.visible_profiles(groups, is_admin):
            a = capacity.availability(profile)
            profiles.append(
                {
                    "slug": profile.slug,
                    "display_name": profile.display_name,
                    "gpus": profile.gpu_label,
                    "gpu_models": sorted(profile.gpu_models),
                    "priority": profile.priority,
                    "free": a.free,
                    "waiting": a.waiting,
                    "label": a.label,
                }
            )
        self.write(
            {
                "inventory": capacity.inventory_label,
                "declared": capacity.inventory_is_declared,
                "quota": capacity.quota_summary(name, groups),
                "profiles": profiles,
            }
        )


class AllocationsAPIHandler(_GPULabAPIHandler):
    """GET /hub/api/gpulab/allocations: every GPU allocation (admins only)."""

    async def get(self) -> None:
        _, _, is_admin = self._caller_groups_admin()
        if not is_admin:
            raise web.HTTPError(403, "Only admins may list all GPU allocations")
        capacity = self.gpu_capacity
        await capacity.ready()
        out: list[dict[str, Any]] = []
        for p in capacity.allocator.allocations():
            out.append(
                {
                    "id": p.request.id,
                    "owner": p.request.owner,
                    "node": p.node,
                    "priority": p.request.priority,
                    "gpus": [{"uuid": s.uuid, "milli": s.milli} for s in p.gpus],
                    "events": capacity.events_for(p.request.id),
                }
            )
        self.write({"inventory": capacity.inventory_label, "allocations": out})


class _WorkspaceHandler(_GPULabAPIHandler):
    def _spawner_for(self, username: str, server: str) -> Any:
        return workspace_actions.workspace_spawner(self, username, server)


class WorkspaceSnapshotsAPIHandler(_WorkspaceHandler):
    """GET /hub/api/gpulab/users/{user}/[servers/{server}/]snapshots: newest first, with the
    kernel checkpoints a start would offer; POST: take one now."""

    async def get(self, username: str, server: str = "") -> None:
        spawner = self._spawner_for(username, server)
        offer = getattr(spawner, "workspace_offer", None)
        kernels = ((await offer()) or {}).get("kernels", []) if offer else []
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


gpulab_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/users/([^/]+)/snapshots", WorkspaceSnapshotsAPIHandler),
    (r"/api/gpulab/users/([^/]+)/servers/([^/]+)/snapshots", WorkspaceSnapshotsAPIHandler),
    (r"/api/gpulab/users/([^/]+)/snapshots/([^/]+)/restore", WorkspaceRestoreAPIHandler),
    (
        r"/api/gpulab/users/([^/]+)/servers/([^/]+)/snapshots/([^/]+)/restore",
        WorkspaceRestoreAPIHandler,
    ),
    (r"/api/gpulab/users/([^/]+)/snapshots/([^/]+)/clone", WorkspaceCloneAPIHandler),
    (
        r"/api/gpulab/users/([^/]+)/servers/([^/]+)/snapshots/([^/]+)/clone",
        WorkspaceCloneAPIHandler,
    ),
    (r"/gpulab/workspaces", WorkspacesPageHandler),
    (r"/api/gpulab/capacity", CapacityAPIHandler),
    (r"/api/gpulab/allocations", AllocationsAPIHandler),
]
