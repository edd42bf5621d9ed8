"""The GPU-hour ledger inside the hub (`GPULedger`): follows the allocator, enforces GPU-hour
budgets, exports counters; the REST API is gpulab.hub.apihandlers.usage."""

from .hub import GPULedger

__all__ = ["GPULedger"]
