"""GET /hub/api/gpulab/allocations: every GPU allocation, for admins and holders of
`custom:gpulab:allocations:read`."""

from __future__ import annotations

from typing import Any

from jupyterhub.scopes import needs_scope

from gpulab.hub.apihandlers.base import GPULabAPIHandler
from gpulab.hub.scopes import ALLOCATIONS_READ


class AllocationsAPIHandler(GPULabAPIHandler):
    """GET /hub/api/gpulab/allocations: every GPU allocation of every user."""

    # admins (admin:users on every user) may, and whoever a role grants gpulab's read-only scope
    @needs_scope(ALLOCATIONS_READ, "admin:users")
    async def get(self) -> None:
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


default_handlers: list[tuple[str, type[Any]]] = [
    (r"/api/gpulab/allocations", AllocationsAPIHandler),
]
