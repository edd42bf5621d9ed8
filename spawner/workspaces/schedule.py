"""Scheduled snapshots of a running server's home, the same on both backends.

A mixin: the spawner says whether it keeps workspaces (`snapshot_schedule_wanted`) and how it
takes one snapshot (`scheduled_snapshot`); this module owns the timer, which runs on the hub's
event loop from a successful start (or a hub restart that finds the server running) until the
server stops or is found gone.
"""

from __future__ import annotations

import asyncio

from traitlets import Integer
from traitlets.config import Configurable

SCHEDULED = "scheduled"


class SnapshotScheduleMixin(Configurable):
    snapshot_interval_seconds = Integer(
        3600,
        config=True,
        help="""Also snapshot a running server's home this often (label 'scheduled'); 0: only on
        stop and on demand. Retention applies to every snapshot alike.""",
    )

    _snapshot_schedule: asyncio.Task[None] | None = None

    def snapshot_schedule_wanted(self) -> bool:
        raise NotImplementedError

    async def scheduled_snapshot(self) -> None:
        raise NotImplementedError

    @property
    def snapshot_schedule_running(self) -> bool:
        return self._snapshot_schedule is not None

    def start_snapshot_schedule(self) -> None:
        if self.snapshot_interval_seconds <= 0 or not self.snapshot_schedule_wanted():
            return
        self.stop_snapshot_schedule()
        self._snapshot_schedule = asyncio.ensure_future(self._snapshot_every_interval())

    def stop_snapshot_schedule(self) -> None:
        if self._snapshot_schedule is not None:
            self._snapshot_schedule.cancel()
            self._snapshot_schedule = None

    async def _snapshot_every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_seconds)
            await self.scheduled_snapshot()  # logs its own failures: the next one is still due
