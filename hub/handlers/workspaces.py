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
from gpulab.spawner.picker import snapshot_time

_PAGE = """
{% extends "page.html" %}
{% block main %}
<div class="container gpulab-workspaces">
  <h1>Workspaces{% if owner != user.name %} of {{ owner }}{% endif %}</h1>
  <p>Every stop keeps a snapshot of the server's home (files, installed packages, environments and
  kernel variables). Restore puts a stopped server's home back as it was (the current home is kept
  as a <em>before-restore</em> snapshot); clone starts a new named server from a snapshot.</p>
  {% if done %}<div class="alert alert-success gpulab-done" role="status">{{ done }}</div>{% endif %}
  {% if error %}<div class="alert alert-danger gpulab-error" role="alert">{{ error }}</div>{% endif %}
  {% for s in servers %}
  <section class="gpulab-server card my-3" data-server="{{ s.name }}">
    <div class="card-header">
      <strong>{{ s.name or "default server" }}</strong>
      {% if s.active %}<span class="badge text-bg-success">running</span>
      {% else %}<span class="badge text-bg-secondary">stopped</span>{% endif %}
      <a class="ms-2" href="{{ base_url }}spawn/{{ owner }}{% if s.name %}/{{ s.name }}{% endif %}">start</a>
      <form method="post" class="d-inline ms-2">
        <input type="hidden" name="_xsrf" value="{{ xsrf_token }}">
        <input type="hidden" name="action" value="snapshot">
        <input type="hidden" name="server" value="{{ s.name }}">
        <button class="btn btn-sm btn-outline-primary gpulab-snapshot-now" type="submit">Snapshot now</button>
      </form>
    </div>
    <div class="card-body">
    {% for k in s.kernels %}
      <p class="gpulab-kernel-checkpoint">Kernel of {{ k.notebook }}: {{ k.offer }}</p>
    {% endfor %}
    {% if not s.snapshots %}<p>No snapshot yet: one is taken each time the server stops.</p>{% else %}
    <table class="table table-sm align-middle">
      <thead><tr><th>Taken</th><th>Why</th><th>Files</th><th>Size</th><th></th></tr></thead>
      <tbody>
      {% for snap in s.snapshots %}
      <tr class="gpulab-snapshot" data-snapshot="{{ snap.id }}">
        <td>{{ snap.created | snapshot_time }}</td><td>{{ snap.label }}</td>
        <td>{{ snap.files }}</td><td>{{ snap.size }}</td>
        <td>
          <form method="post" class="d-inline">
            <input type="hidden" name="_xsrf" value="{{ xsrf_token }}">
            <input type="hidden" name="action" value="restore">
            <input type="hidden" name="server" value="{{ s.name }}">
            <input type="hidden" name="snapshot" value="{{ snap.id }}">
            <button class="btn btn-sm btn-outline-primary gpulab-restore" type="submit"
              {% if s.busy %}disabled title="Stop {{ s.busy }} first: it uses this home"{% endif %}>Restore</button>
          </form>
          <form method="post" class="d-inline ms-2">
            <input type="hidden" name="_xsrf" value="{{ xsrf_token }}">
            <input type="hidden" name="action" value="clone">
            <input type="hidden" name="server" value="{{ s.name }}">
            <input type="hidden" name="snapshot" value="{{ snap.id }}">
            <input name="name" class="form-control form-control-sm d-inline w-auto gpulab-clone-name"
                   placeholder="new server name" pattern="[a-z0-9][a-z0-9-]*" required>
            <button class="btn btn-sm btn-outline-secondary gpulab-clone" type="submit">Clone</button>
          </form>
        </td>
      </tr>
      {% endfor %}
      </tbody>
    </table>
    {% endif %}
    </div>
  </section>
  {% endfor %}
</div>
{% endblock %}
"""


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
        default = workspace_actions.workspace_spawner(self, owner, "")
        servers = []
        for name in sorted(default.user.orm_spawners):
            spawner = default.user.spawners[name]
            if not hasattr(spawner, "list_workspace_snapshots"):
                continue
            offer = await spawner.workspace_offer() if hasattr(spawner, "workspace_offer") else None
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
        ns: dict[str, Any] = dict(self.template_namespace)
        ns.update(
            xsrf_token=self.xsrf_token.decode("ascii"),
            owner=owner,
            servers=servers,
            done=done,
            error=error,
        )
        return str(env.from_string(_PAGE).render(**ns))

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
            spawner = workspace_actions.workspace_spawner(self, owner, server)
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
