"""The profile picker: HTML for JupyterHub's spawn form, with live capacity per profile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jinja2 import Environment, select_autoescape

from gpulab.hub.capacity import ProfileAvailability


@dataclass(frozen=True)
class PickerRow:
    availability: ProfileAvailability
    isolation: str
    checked: bool
    disabled: bool = False

    @property
    def slug(self) -> str:
        return self.availability.profile.slug

    @property
    def full(self) -> bool:
        return self.availability.profile.gpu > 0 and self.availability.free == 0


_TEMPLATE = Environment(autoescape=select_autoescape(default=True)).from_string(
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
  <label class="gpulab-profile{% if row.full %} gpulab-full{% endif %}" for="profile-{{ row.slug }}"
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
  </label>
  {% endfor %}
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
) -> str:
    return _TEMPLATE.render(
        rows=rows, inventory_label=inventory_label, declared=declared, quota=quota, notices=notices
    )
