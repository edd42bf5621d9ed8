"""Warm pools (pure): which pools an admin configured, how many ready members each wants now, and
what to start or stop to get there. The hub side that runs them is `gpulab.hub.warmpoolservice`."""

from __future__ import annotations

from .model import (
    WARM_POOL_OWNER,
    Member,
    Plan,
    PoolConfigError,
    PoolSpec,
    Window,
    is_pool_allocation,
    member_allocation_id,
    parse_pools,
    parse_schedule,
    plan,
)

__all__ = [
    "WARM_POOL_OWNER",
    "Member",
    "Plan",
    "PoolConfigError",
    "PoolSpec",
    "Window",
    "is_pool_allocation",
    "member_allocation_id",
    "parse_pools",
    "parse_schedule",
    "plan",
]
