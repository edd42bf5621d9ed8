"""GET /hub/api/gpulab/capacity: the caller's GPU profiles with free and waiting counts, and quota,
and which profile a start without options (VS Code's empty body) would get."""

from __future__ import annotations

from typing import Any

from tornado import web

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.warmpoolservice import GPUWarmPool

#: how a start without options picks its profile (`gpulab.hub.handlers.servers`), for clients
#: such as VS Code that cannot send options
EMPTY_START = (
    "A start without options (an empty body) of a named server called like one of these "
    "profiles' slugs uses that profile; any other start without options uses default_profile."
)


class CapacityAPIHandler(GPULabAPIHandler):
    """GET /hub/api/gpulab/capacity: the caller's profiles with free and waiting counts."""

    async def get(self) -> None:
        caller = self.current_user
        if caller is None:
            raise web.HTTPError(403, "Authentication required")
        groups = self.caller_groups()
        capacity = self.gpu_capacity
        await capacity.ready()
        pool = GPUWarmPool.instance(config=self.settings["config"], log=self.log)
        profiles = []
        for profile in capacity.visible_profiles(groups, self.sees_every_profile()):
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
                    # pre-started servers of this profile a start would take now (warm pools)
                    "ready_now": pool.ready_count(profile.slug),
                }
            )
        default = capacity.default_profile(groups, self.sees_every_profile())
        self.write(
            {
                "default_profile": default.slug if default is not None else None,
                "empty_start": EMPTY_START,
                "inventory": capacity.inventory_label,
                "declared": capacity.inventory_is_declared,
                "quota": capacity.quota_summary(caller.name, groups),
                "profiles": profiles,
            }
        )


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/capacity", CapacityAPIHandler),
]
