"""Restore and clone of server workspaces, shared by the REST API and the workspaces page.

Each action is all or nothing: a clone that fails leaves no new server behind, and a restore
runs only on a stopped server.
"""

from __future__ import annotations

from typing import Any

from jupyterhub.slugs import is_valid_safe_slug
from tornado import web


def workspace_spawner(handler: Any, username: str, server: str) -> Any:
    """The spawner of `username`'s server, for its owner or an admin (else 403/404/400)."""
    caller = handler.current_user
    if caller is None:
        raise web.HTTPError(403, "Authentication required")
    is_admin = bool(getattr(caller, "admin", False)) or "admin:users" in handler.expanded_scopes
    if caller.name != username and not is_admin:
        raise web.HTTPError(403, f"Only {username!r} and admins may see {username!r}'s snapshots")
    user = handler.find_user(username)
    if user is None:
        raise web.HTTPError(404, f"No such user {username!r}")
    if server and server not in user.orm_spawners:
        raise web.HTTPError(404, f"{username} has no server named {server!r}")
    spawner = user.spawners[server]
    if not hasattr(spawner, "restore_workspace"):
        raise web.HTTPError(400, f"{type(spawner).__name__} keeps no workspace snapshots")
    return spawner


async def restore(handler: Any, spawner: Any, snapshot_id: str) -> dict[str, Any]:
    label = f"{spawner.user.name}/{spawner.name}"
    if spawner.active:
        raise web.HTTPError(409, f"Stop server {label} before restoring its workspace")
    try:
        result: dict[str, Any] = await spawner.restore_workspace(snapshot_id)
    except KeyError:
        raise web.HTTPError(404, f"No snapshot {snapshot_id!r} for {label}") from None
    # a restore may change what the spawner remembers (Kubernetes: the home PVC's name)
    spawner.orm_spawner.state = spawner.get_state()
    handler.db.commit()
    return result


async def take_snapshot(spawner: Any) -> dict[str, Any]:
    label = f"{spawner.user.name}/{spawner.name}"
    if not hasattr(spawner, "take_workspace_snapshot"):
        raise web.HTTPError(400, f"{type(spawner).__name__} cannot take snapshots on demand")
    snap: dict[str, Any] | None = await spawner.take_workspace_snapshot()
    if snap is None:
        raise web.HTTPError(409, f"{label} has no workspace yet: start it once first")
    return snap


async def clone(handler: Any, spawner: Any, snapshot_id: str, new_name: Any) -> dict[str, Any]:
    """A new named server of the same user whose home starts as `snapshot_id` of `spawner`."""
    user = spawner.user
    if not isinstance(new_name, str) or not new_name:
        raise web.HTTPError(400, 'Give the new server a \'name\', e.g. {"name": "experiment-2"}')
    if not handler.allow_named_servers:
        raise web.HTTPError(400, "Named servers are not enabled (c.JupyterHub.allow_named_servers)")
    if new_name == "default" or not is_valid_safe_slug(new_name):
        raise web.HTTPError(
            400,
            f"Invalid server name {new_name!r}: use lowercase letters, digits and '-' "
            "('default' is reserved)",
        )
    if new_name in user.orm_spawners:
        raise web.HTTPError(409, f"{user.name} already has a server named {new_name!r}")
    limit = await handler.get_current_user_named_server_limit()
    named = [name for name in user.orm_spawners if name]
    if limit and len(named) >= limit:
        raise web.HTTPError(
            400, f"{user.name} already has {len(named)} named servers, the limit is {limit}"
        )
    try:
        spawner.snapshot_store  # noqa: B018 - fail before creating anything
    except AttributeError:
        raise web.HTTPError(400, f"{type(spawner).__name__} cannot clone workspaces") from None
    target = user.get_or_create_spawner(new_name, new_name)
    try:
        result: dict[str, Any] = await spawner.clone_workspace(snapshot_id, target)
    except BaseException as e:
        # nothing half-done: the new server goes again
        user.spawners.pop(new_name, None)
        handler.db.delete(target.orm_spawner)
        handler.db.commit()
        if isinstance(e, KeyError):
            raise web.HTTPError(
                404, f"No snapshot {snapshot_id!r} for {user.name}/{spawner.name}"
            ) from None
        if isinstance(e, FileExistsError):
            raise web.HTTPError(409, f"Server {new_name!r} already has a workspace") from None
        raise
    target.orm_spawner.state = target.get_state()
    handler.db.commit()
    result["url"] = f"{handler.hub.base_url}spawn/{user.escaped_name}/{new_name}"
    return result
