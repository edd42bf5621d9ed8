"""The profile picker: HTML for JupyterHub's spawn form, with live capacity per profile."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import Environment, select_autoescape

from gpulab.hub.capacity import ProfileAvailability


@dataclass(frozen=True)
class PickerRow:
    availability: ProfileAvailability
    isolation: str
    checked: bool
    disabled: bool = False
    #: why a disabled profile cannot be picked now, shown under it
    reason: str = ""

    @property
    def slug(self) -> str:
        return self.availability.profile.slug

    @property
    def full(self) -> bool:
        return self.availability.profile.gpu > 0 and self.availability.free == 0


def snapshot_time(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created))


_ENV = Environment(autoescape=select_autoescape(default=True))
_ENV.filters["snapshot_time"] = snapshot_time
_TEMPLATE = _ENV.from_string(
    """
<div class="gpulab-picker" data-inventory="{{ 'declared' if declared else 'measured' }}">
  <p class="gpulab-inventory">
    GPUs: {{ inventory_label }}
    {%- if declared %} <span class="badge text-bg-warning" title="No NVIDIA driver on this machine: the
    GPUs are declared in the hub config, not measured.">declared</span>{% endif %}
  </p>
  {% for notice in notices %}<div class="alert alert-warning gpulab-notice">{{ notice }}</div>{% endfor %}
  {% if quota %}<p class="gpulab-quota">{{ quota }}</p>{% endif %}
  {% for row in rows %}
  <label class="gpulab-profile{% if row.full %} gpulab-full{% endif %}{% if row.disabled %} gpulab-closed{% endif %}" for="profile-{{ row.slug }}"
         style="display:block;border:1px solid #ccc;border-radius:4px;padding:8px;margin:6px 0;
                {%- if row.disabled %}opacity:0.55;{% endif %}">
    <input type="radio" name="profile" id="profile-{{ row.slug }}" value="{{ row.slug }}"
           {% if row.checked and not row.disabled %}checked{% endif %}
           {% if row.disabled %}disabled{% endif %}>
    <strong>{{ row.availability.profile.display_name }}</strong>
    <span class="gpulab-capacity" data-free="{{ row.availability.free }}"
          data-waiting="{{ row.availability.waiting }}">({{ row.availability.label }})</span>
    {% if row.availability.profile.gpu_models %}
      <span class="gpulab-models">{{ row.availability.profile.gpu_models | sort | join(' or ') }}</span>
    {% endif %}
    {% if row.availability.profile.priority == 'preemptible' %}
      <span class="badge text-bg-info">preemptible</span>
    {% endif %}
    {% if row.availability.profile.description %}
      <br><small>{{ row.availability.profile.description }}</small>
    {% endif %}
    <br><small class="gpulab-isolation">{{ row.isolation }}</small>
    {% if row.disabled and row.reason %}
      <br><small class="gpulab-closed-reason text-danger">{{ row.reason }}</small>
    {% endif %}
  </label>
  {% endfor %}
  {% if workspace is not none %}
  <fieldset class="gpulab-workspace" style="border:1px solid #ccc;border-radius:4px;padding:8px;margin:12px 0">
    <legend style="font-size:1em;font-weight:bold;width:auto;padding:0 4px">Workspace</legend>
    {% if workspace.kernels %}
    <label class="gpulab-kernel-offer" style="display:block">
      <input type="checkbox" name="restore_kernels" value="1" checked>
      Restore kernel variables as you left them:
      {% for k in workspace.kernels %}
      <span class="gpulab-kernel-checkpoint" data-notebook="{{ k.notebook }}">
        {{ k.offer }}{% if workspace.kernels | length > 1 %} in {{ k.notebook }}{% endif %}</span>{% if not loop.last %};{% endif %}
      {% endfor %}
    </label>
    <small>Unticked, each notebook still offers its variables (<code>%gpulab_restore</code>).</small>
    {% endif %}
    {% if workspace.snapshots %}
    <label for="gpulab-restore-snapshot" style="display:block;margin-top:6px">Files and packages</label>
    <select name="restore_snapshot" id="gpulab-restore-snapshot" class="form-select">
      <option value="" selected>As you left them</option>
      {% for snap in workspace.snapshots %}
      <option value="{{ snap.id }}">Restore snapshot {{ snap.created | snapshot_time }} ({{ snap.label }}, {{ snap.files }} files, {{ snap.size }})</option>
      {% endfor %}
    </select>
    <small>Restoring keeps the current home as a 'before-restore' snapshot.</small>
    {% elif not workspace.kernels %}
    <p class="gpulab-workspace-new">A new workspace: files, packages and kernel variables are kept from here on.</p>
    {% endif %}
    {% if workspaces_url %}<p style="margin:6px 0 0"><a href="{{ workspaces_url }}">All snapshots: restore or clone into a new server</a></p>{% endif %}
  </fieldset>
  {% endif %}
</div>
"""
)


def render_picker(
    rows: Sequence[PickerRow],
    *,
    inventory_label: str,
    declared: bool,
    quota: str | None,
    notices: Sequence[str] = (),
    workspace: Mapping[str, Any] | None = None,
    workspaces_url: str = "",
) -> str:
    """`workspace`: the spawner's workspace_offer() (kernel checkpoints and home snapshots), or
    None when the spawner keeps no workspace."""
    return _TEMPLATE.render(
        rows=rows,
        inventory_label=inventory_label,
        declared=declared,
        quota=quota,
        notices=notices,
        workspace=workspace,
        workspaces_url=workspaces_url,
    )
