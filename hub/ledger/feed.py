"""From the allocator's changes to ledger writes, in order, without holding the allocator up.

`LedgerFeed.listener` is registered with `Allocator.add_listener`: it runs inside the allocator's
lock (so snapshots are queued in exactly the order of the changes) and only appends the snapshot
and its time. `flush()` writes the queued snapshots, oldest first, each with its own time (the
ledger is exact to the second even when writes lag); the hub calls it from a worker thread.

A snapshot is the whole set of allocations held after a change, so every write is a `diff`
against what the ledger has open: a change the ledger missed (a crash between the change and its
write, pods that vanished while the hub was down, a node lost) is repaired by the next snapshot,
and `Allocator.notify_listeners()` makes one on demand (start-up and periodic reconciliation).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpulab.hub.allocator import Inventory, Placement

from .model import Change, DeviceInfo, Holding, holdings, whole_second
from .store import LedgerStore


@dataclass(frozen=True)
class Snapshot:
    t: float
    placements: tuple[Placement, ...]
    removed: dict[str, str]
    inventory: Inventory


def device_table(inventory: Inventory) -> dict[str, DeviceInfo]:
    return {
        gpu.uuid: DeviceInfo(gpu.model, gpu.mig_profile)
        for node in inventory.nodes
        for gpu in node.gpus
    }


def holdings_of(placements: Iterable[Placement], devices: dict[str, DeviceInfo]) -> list[Holding]:
    out: list[Holding] = []
    for p in placements:
        shares = [(s.uuid, s.milli) for s in p.gpus]
        out += holdings(p.request.id, p.request, p.node, shares, devices.get)
    return out


class LedgerFeed:
    """Queues the allocator's snapshots and writes them to a `LedgerStore`."""

    def __init__(
        self,
        store: LedgerStore,
        inventory: Callable[[], Inventory],
        *,
        clock: Callable[[], float] = time.time,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.inventory = inventory
        self.clock = clock
        self.on_queued = on_queued
        self._queue: collections.deque[Snapshot] = collections.deque()
        self._flushing = threading.Lock()
        self._last_t = 0
        #: snapshots written so far
        self.written = 0

    def listener(self, placements: list[Placement], removed: dict[str, str]) -> None:
        """`Allocator.add_listener`'s callback: quick, and never calls the allocator."""
        self._queue.append(
            Snapshot(self.clock(), tuple(placements), dict(removed), self.inventory())
        )
        if self.on_queued is not None:
            self.on_queued()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def flush(self) -> list[Change]:
        """Write every queued snapshot, oldest first (one writer at a time)."""
        changes = []
        with self._flushing:
            while self._queue:
                snapshot = self._queue[0]
                devices = device_table(snapshot.inventory)
                # never back in time: a clock step back must not end an interval before it began
                t = max(self._last_t, whole_second(snapshot.t))
                change = self.store.sync(
                    holdings_of(snapshot.placements, devices),
                    t,
                    reasons=snapshot.removed,
                    live_nodes=frozenset(n.name for n in snapshot.inventory.nodes),
                    started={p.request.id: p.created_at for p in snapshot.placements},
                )
                self._queue.popleft()  # only once written: a failed write is tried again
                self._last_t = t
                self.written += 1
                if change:
                    changes.append(change)
        return changes
