"""The profile picker: HTML for JupyterHub's spawn form, with live capacity per profile."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from gpulab.hub.capacity_catalog import HourBudgetStanding, ProfileAvailability


@dataclass(frozen=True)
class PickerRow:
    availability: ProfileAvailability
    isolation: str
    checked: bool
    disabled: bool = False
    #: why a disabled profile cannot be picked now, shown under it
    reason: str = ""
    #: pre-started servers of this profile ready to be taken (a warm pool): "ready now"
    ready_now: int = 0

    @property
    def slug(self) -> str:
        return self.availability.profile.slug

    @property
    def full(self) -> bool:
        return self.availability.profile.gpu > 0 and self.availability.free == 0


def snapshot_time(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created))


#: hub/templates, where the hub's own pages are too (gpulab.hub is this package's hub side)
TEMPLATES = Path(str(files("gpulab.hub").joinpath("templates")))
_ENV = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True))
_ENV.filters["snapshot_time"] = snapshot_time
_TEMPLATE = _ENV.get_template("gpulab-picker.html")


def render_picker(
    rows: Sequence[PickerRow],
    *,
    inventory_label: str,
    declared: bool,
    quota: str | None,
    notices: Sequence[str] = (),
    workspace: Mapping[str, Any] | None = None,
    workspaces_url: str = "",
    hour_budget: HourBudgetStanding | None = None,
) -> str:
    """`workspace`: the spawner's workspace_offer() (kernel checkpoints and home snapshots), or
    None when the spawner keeps no workspace. `hour_budget`: the user's tightest GPU-hour budget
    (None when none binds her)."""
    return _TEMPLATE.render(
        rows=rows,
        inventory_label=inventory_label,
        declared=declared,
        quota=quota,
        notices=notices,
        workspace=workspace,
        workspaces_url=workspaces_url,
        hour_budget=hour_budget,
    )
