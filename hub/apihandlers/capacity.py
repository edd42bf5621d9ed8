"""GET /hub/api/gpulab/capacity: the caller's GPU profiles with free and waiting counts, and quota,
and which profile a start without options (VS Code's empty body) would get."""

from __future__ import annotations

from typing import Any

from tornado import web

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.jobservice.service import whole_quota_refusal
from gpulab.hub.profiles import Profile
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
                    # why a job or a Dask cluster of it would be refused if submitted now ('':
                    # accepted), so that the lab's dialogs mark it before Submit, as the picker
                    "refused": workload_refusals(capacity, profile, caller.name, groups),
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


def workload_refusals(
    capacity: GPUCapacity, profile: Profile, owner: str, groups: frozenset[str]
) -> dict[str, str]:
    """`{"job": why, "dask": why}`: the refusals a submission of `profile` would get now ('' for
    none), the same checks as `JobService.submit` (larger than any machine, more than her whole
    quota: a run waits for quota otherwise) and `DaskService.create` (a worker beyond the quota
    she has left)."""
    if not capacity.fits_inventory(profile):
        return {"job": "Larger than any machine here", "dask": "Larger than any machine here"}
    job = whole_quota_refusal(capacity, profile, owner, groups) or ""
    return {"job": job, "dask": capacity.over_quota(profile, owner, groups) or ""}


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/capacity", CapacityAPIHandler),
]
