"""Warm pools inside a running hub: `GPUWarmPool` keeps pre-started servers of chosen profiles
ready on preemptible GPU reservations, and hands one to the first user who starts that profile."""

from __future__ import annotations

from .hub import (
    GPUWarmPool,
    KeepsWarmServers,
    SweepsMembers,
    WarmBackend,
    WarmMemberHandle,
    WarmStartFailed,
)

__all__ = [
    "GPUWarmPool",
    "KeepsWarmServers",
    "SweepsMembers",
    "WarmBackend",
    "WarmMemberHandle",
    "WarmStartFailed",
]
