"""What the hub's in-process services (GPU jobs, Dask clusters, the ledger, the culler) share:
starting once the hub has, answering "has it started?" with a bounded wait, an admission loop
woken on demand, and stopping a server without a request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any


async def hub_started(app: Any) -> None:
    """Return once JupyterHub's start has finished (users, spawners, proxy): it resolves
    `_start_future` then; a hub without it (an older one) has started by the time a task runs."""
    started = getattr(app, "_start_future", None)
    if started is not None:
        await asyncio.shield(started)


async def wait_started(starting: asyncio.Future[Any] | None, timeout: float) -> None:
    """Return once `starting` (a service's start) has ended, however, or after `timeout` s."""
    if starting is not None and not starting.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(starting), timeout)


async def cancel_and_wait(task: asyncio.Future[Any] | None) -> None:
    """Cancel a service's background task and return once it has ended (None: nothing to do)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def admission_loop(
    admit: Callable[[], Awaitable[Any]],
    wake: asyncio.Event,
    interval_seconds: float,
    log: logging.Logger,
    what: str,
) -> None:
    """Run `admit` whenever `wake` is set and every `interval_seconds` (quotas and capacity
    change without telling anyone), for good: a failed pass is logged and tried again."""
    while True:
        wake.clear()
        try:
            await admit()
        except Exception:  # a store or allocator error must not end admission for good
            log.exception("%s admission pass failed; trying again", what)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval_seconds)


async def stop_server(
    app: Any, user: Any, name: str, before_stop: Callable[[], None] | None = None
) -> bool:
    """Stop a server as JupyterHub's API does (`BaseHandler.stop_single_user`): off the proxy,
    then `user.stop`, which runs the spawner's stop and post-stop hook. `before_stop` runs once
    the stop is certain, before anything async (the caller notes why the share ends, for the
    GPU-hour ledger).

    A server with a start (or stop) still pending is left alone and False returned: stopping
    under JupyterHub's pending spawn makes the start's request fail with a 500 (its spawn future
    has no result and no exception), and callers check again on their next round, by which time
    the server is ready and stops cleanly."""
    spawner = user.spawners[name]
    if spawner.pending:
        return False
    if before_stop is not None:
        before_stop()
    spawner._stop_pending = True  # before anything async, as JupyterHub does: no race with a start
    try:
        await app.proxy.delete_user(user, name)
    finally:
        spawner._stop_pending = False
    await user.stop(name)
    return True
