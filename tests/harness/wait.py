"""One way to wait for a condition in tests and benchmarks: poll, bounded by a timeout.

A wait that runs out raises `WaitTimeout`, an AssertionError (pytest reports it as the test's
failure, naming what was awaited and the last value seen) that is also a TimeoutError (callers
outside pytest, the benchmarks, catch it as one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError, TimeoutError):
    """A condition that did not hold within its timeout."""


def _message(what: str, timeout: float, last: object) -> str:
    return f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})"[:3000]


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = 60, interval: float = 0.2
) -> T:
    """Poll `check()` until it returns something truthy and return that; raise WaitTimeout naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise WaitTimeout(_message(what, timeout, last))
        time.sleep(interval)


async def wait_for_async(
    what: str, check: Callable[[], Awaitable[T | None]], timeout: float = 60, interval: float = 0.2
) -> T:
    """`wait_for` for a coroutine check, from async code (the event loop keeps running)."""
    deadline = time.monotonic() + timeout
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise WaitTimeout(_message(what, timeout, last))
        await asyncio.sleep(interval)
