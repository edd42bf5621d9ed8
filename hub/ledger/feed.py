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
        self._devices_of: Inventory | None = None
        self._devices: dict[str, DeviceInfo] = {}
        self._converted: dict[tuple[str, float], list[Holding]] = {}

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

    @property
    def oldest_queued(self) -> float | None:
        """When the oldest snapshot not yet written was taken (None: nothing queued)."""
        return self._queue[0].t if self._queue else None

    def flush(self, batch: int = 200) -> list[Change]:
        """Write every queued snapshot, oldest first (one writer at a time; up to `batch`
        snapshots per transaction)."""
        changes: list[Change] = []
        with self._flushing:
            while self._queue:
                taken = [self._queue[i] for i in range(min(batch, len(self._queue)))]
                writes = []
                last_t = self._last_t
                for snapshot in taken:
                    # never back in time: a clock step back must not end an interval before it began
                    last_t = max(last_t, whole_second(snapshot.t))
                    held = self._holdings(snapshot)
                    live_nodes = frozenset(n.name for n in snapshot.inventory.nodes)
                    started = {p.request.id: p.created_at for p in snapshot.placements}
                    kw = {"reasons": snapshot.removed, "live_nodes": live_nodes, "started": started}
                    writes.append((held, last_t, kw))
                written = self.store.sync_many(writes)
                for _ in taken:  # only once written: a failed write is tried again
                    self._queue.popleft()
                self._last_t = last_t
                self.written += len(taken)
                changes += [c for c in written if c]
        return changes

    def _holdings(self, snapshot: Snapshot) -> list[Holding]:
        """The snapshot's holdings; a placement seen before is not converted again (snapshots
        repeat every allocation held, and placements never change)."""
        if snapshot.inventory is not self._devices_of:
            self._devices_of, self._devices = snapshot.inventory, device_table(snapshot.inventory)
            self._converted.clear()
        out: list[Holding] = []
        seen: dict[tuple[str, float], list[Holding]] = {}
        for p in snapshot.placements:
            key = (p.request.id, p.created_at)
            found = self._converted.get(key)
            if found is None:
                found = holdings_of([p], self._devices)
            seen[key] = found
            out += found
        self._converted = seen
        return out
