"""Allocation errors: each carries a ``reason`` sentence a user or admin can act on."""

from __future__ import annotations


class AllocationError(Exception):
    """Base of every allocator error; ``reason`` says what was wrong and what would be right."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidRequest(AllocationError):
    """The request itself is malformed (negative values, both whole and fractional GPUs, ...)."""


class InvalidQuota(AllocationError, ValueError):
    """A budget is not an int of milli-GPU >= 0 (nan, inf, a float, a bool...); names the field."""


class NoCapacity(AllocationError):
    """No node can take the request right now (or ever, when the reason says so)."""


class QuotaExceeded(AllocationError):
    """Placing the request would take its owner or one of its groups over the GPU budget."""


class AlreadyAllocated(AllocationError):
    """An allocation with the same request id is already held."""


class StaleAllocations(AllocationError):
    """Persisted allocations no longer fit the configured inventory (raised by ``strict`` opens)."""
