"""What every gpulab REST handler shares: a bounded body, the GPU capacity, the caller.

Every body is capped at 64 KiB (413) before it is parsed; values echoed in errors are shortened.
"""

from __future__ import annotations

from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import has_scope

from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.refusals import check_body_size


class GPULabAPIHandler(APIHandler):
    """Base of gpulab's handlers under /hub/api/gpulab/."""

    async def prepare(self) -> None:
        # before authentication and parsing: an oversized body costs nothing more than reading it
        check_body_size(self)
        await super().prepare()

    @property
    def gpu_capacity(self) -> GPUCapacity:
        return GPUCapacity.instance(config=self.settings["config"], log=self.log)

    def caller_groups(self) -> frozenset[str]:
        """The groups of the (authenticated) caller; a service has none."""
        return frozenset(g.name for g in getattr(self.current_user, "groups", []) or [])

    def sees_every_profile(self) -> bool:
        """Whether the caller may see profiles restricted to groups it is not in: whoever may
        administer every user (admin:users on all of them, as the admin role has)."""
        return bool(has_scope("admin:users", self.parsed_scopes))
