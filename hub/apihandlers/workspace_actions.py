"""Restore and clone of server workspaces, shared by the REST API and the workspaces page.

Each action is all or nothing: a clone that fails leaves no new server behind, and a restore or a
clone runs only while no server using that home runs (a renamed server keeps its home, so two
servers of a user can share one; the default server's home is `default`).
"""

from __future__ import annotations

from typing import Any

from jupyterhub.scopes import Scope
from jupyterhub.slugs import is_valid_safe_slug
from tornado import web

from gpulab.hub.refusals import refusal, shown
from gpulab.hub.workspaces import DEFAULT_HOME, Workspaces, keeps_workspaces
from gpulab.spawner.names import is_workload_name


def home_dir_name(spawner: Any) -> str:
    """The name of a server's home directory (`Workspaces.workspace_dir_name`); for a spawner
    that keeps no workspace, its name (`default` for the default server)."""
    if keeps_workspaces(spawner):
        return str(spawner.workspace_dir_name)
    return str(spawner.name or DEFAULT_HOME)


def home_of(spawner: Any) -> str:
    """What identifies the storage a server's home lives on (`Workspaces.workspace_home_id`:
    on Kubernetes the home PVC, elsewhere the home directory's name)."""
    if keeps_workspaces(spawner):
        return str(spawner.workspace_home_id())
    return home_dir_name(spawner)


def servers_using_home(user: Any, home: str, key: Any = home_of) -> list[Any]:
    """Every server of `user` (loaded from its record) whose `key(spawner)` is `home`."""
    spawners = [user.spawners[name] for name in sorted(user.orm_spawners)]
    return [s for s in spawners if key(s) == home]


def running_label(spawners: list[Any]) -> str:
    return ", ".join(repr(s.name) if s.name else "the default server" for s in spawners)


def refuse_while_home_in_use(spawner: Any, action: str) -> None:
    """409 while any server using `spawner`'s home runs (or is starting or stopping)."""
    home = home_of(spawner)
    running = [s for s in servers_using_home(spawner.user, home) if s.active]
    if running:
        raise refusal(
            409,
            f"Cannot {action} home {home!r} of {spawner.user.name} while {running_label(running)} "
            "uses it: stop that server first",
        )


def check_new_server_name(user: Any, server_name: str, renamed_from: str | None = None) -> None:
    """400 for a new named server whose home would be another server's: `default` (the default
    server's home) or the kept home of a renamed server, or whose allocation id would be a job
    run's or Dask worker's. Called before any record exists."""
    if server_name == DEFAULT_HOME:
        raise refusal(400, "The server name 'default' is reserved: it is the default server's home")
    if is_workload_name(server_name):
        # a server's allocation id is "<user>/<name>": it would be a job run's or Dask worker's
        raise refusal(
            400,
            f"The server name {server_name!r} is reserved: names like job-<n> and dask-<n>-w<n>"
            " are gpulab's job runs and Dask workers",
        )
    owners = [
        s
        for s in servers_using_home(user, server_name, key=home_dir_name)
        if s.name not in (server_name, renamed_from)
    ]
    if owners:
        raise refusal(
            400,
            f"The server name {server_name!r} is taken: it is the home of {user.name}'s server "
            f"{running_label(owners)} (a renamed server keeps its home); pick another name",
        )


#: the JupyterHub scopes workspace actions need on the server's owner: reading lists snapshots and
#: offers; taking, restoring and cloning change what the user's servers hold, as starting one does
READ, CHANGE = "read:servers", "servers"


def scoped_user(handler: Any, username: str, scope: str) -> tuple[Any, Any]:
    """The hub user `username` and the request's filter for JupyterHub's `scope`; 403 without
    authentication, and for a user that does not exist unless the caller may act on every user
    (404: only such a caller learns that this one does not exist)."""
    if handler.current_user is None:
        raise web.HTTPError(403, "Authentication required")
    may = handler.get_scope_filter(scope)
    user = handler.find_user(username)
    if user is None:
        may_all = handler.parsed_scopes.get(scope) is Scope.ALL
        raise web.HTTPError(404 if may_all else 403, f"No such user {shown(username)}")
    return user, may


def workspace_spawner(handler: Any, username: str, server: str, scope: str) -> Workspaces:
    """The spawner of `username`'s server, when the request holds JupyterHub's `scope` for it
    (its owner and admins do, through JupyterHub's default roles; any role may grant it, filtered
    by user, group or server), else 403; 404 for a user or server that does not exist."""
    user, may = scoped_user(handler, username, scope)
    orm_server = user.orm_spawners.get(server)
    allowed = may(orm_server, kind="server") if orm_server else may(user.orm_user, kind="user")
    if not allowed:
        raise web.HTTPError(
            403, f"You lack the scope {scope!r} on user {shown(username)} (servers and snapshots)"
        )
    if server and orm_server is None:
        raise web.HTTPError(404, f"{username} has no server named {shown(server)}")
    spawner = user.spawners[server]
    if not keeps_workspaces(spawner):
        raise web.HTTPError(400, f"{type(spawner).__name__} keeps no workspace snapshots")
    return spawner  # type: ignore[no-any-return]


async def restore(handler: Any, spawner: Any, snapshot_id: str) -> dict[str, Any]:
    label = f"{spawner.user.name}/{spawner.name}"
    refuse_while_home_in_use(spawner, "restore")
    try:
        result: dict[str, Any] = await spawner.restore_workspace(snapshot_id)
    except KeyError:
        raise web.HTTPError(404, f"No snapshot {shown(snapshot_id)} for {label}") from None
    # a restore may change what the spawner remembers (Kubernetes: the home PVC's name)
    spawner.orm_spawner.state = spawner.get_state()
    handler.db.commit()
    return result


async def take_snapshot(spawner: Any) -> dict[str, Any]:
    label = f"{spawner.user.name}/{spawner.name}"
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
    if new_name == DEFAULT_HOME or not is_valid_safe_slug(new_name):
        raise web.HTTPError(
            400,
            f"Invalid server name {shown(new_name)}: use lowercase letters, digits and '-' "
            "('default' is reserved)",
        )
    if new_name in user.orm_spawners:
        raise web.HTTPError(409, f"{user.name} already has a server named {new_name!r}")
    check_new_server_name(user, new_name)
    # the snapshot is read from the source's home: a server writing to it must stop first
    refuse_while_home_in_use(spawner, "clone")
    limit = await handler.get_current_user_named_server_limit()
    named = [name for name in user.orm_spawners if name]
    if limit and len(named) >= limit:
        raise web.HTTPError(
            400, f"{user.name} already has {len(named)} named servers, the limit is {limit}"
        )
    if not keeps_workspaces(spawner):  # before anything is created
        raise web.HTTPError(400, f"{type(spawner).__name__} cannot clone workspaces")
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
                404, f"No snapshot {shown(snapshot_id)} for {user.name}/{spawner.name}"
            ) from None
        if isinstance(e, FileExistsError):
            raise web.HTTPError(409, f"Server {new_name!r} already has a workspace") from None
        raise
    target.orm_spawner.state = target.get_state()
    handler.db.commit()
    result["url"] = f"{handler.hub.base_url}spawn/{user.escaped_name}/{new_name}"
    return result
