"""List-and-watch caches of Kubernetes objects (plain dicts), for nodes and pods cluster-wide.

KubeSpawner's reflectors key objects by namespace and cannot hold Nodes, so gpulab keeps its own
small cache: a full list, then a watch from that resourceVersion, relisting on expiry or error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

ChangeHandler = Callable[[str, dict[str, Any]], Awaitable[None] | None]


def object_key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]


class WatchCache:
    """`objects` mirrors the API server; `on_change(type, obj)` runs for every ADDED/MODIFIED/DELETED."""

    def __init__(
        self,
        api_client: ApiClient,
        list_method: Callable[..., Any],
        *,
        on_change: ChangeHandler | None = None,
        log: logging.Logger | None = None,
        watch_timeout_seconds: int = 60,
        **list_kwargs: Any,
    ) -> None:
        self.api_client = api_client
        self.list_method = list_method
        self.list_kwargs = list_kwargs
        self.on_change = on_change
        self.log = log or logging.getLogger("gpulab.kube")
        self.watch_timeout_seconds = watch_timeout_seconds
        self.objects: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        if self.on_change is None:
            return
        result = self.on_change(kind, obj)
        if result is not None:
            await result

    async def _relist(self) -> str:
        listing = await self.list_method(**self.list_kwargs)
        items = self.api_client.sanitize_for_serialization(listing)
        fresh = {object_key(o): o for o in items.get("items", [])}
        gone = [k for k in self.objects if k not in fresh]
        for key in gone:
            await self._emit("DELETED", self.objects.pop(key))
        for key, obj in fresh.items():
            kind = "MODIFIED" if key in self.objects else "ADDED"
            self.objects[key] = obj
            await self._emit(kind, obj)
        return str(items["metadata"].get("resourceVersion") or "")

    async def _run(self) -> None:
        backoff = 0.5
        while True:
            try:
                version = await self._relist()
                self.synced.set()
                backoff = 0.5
                w = watch.Watch()
                async with w.stream(
                    self.list_method,
                    resource_version=version,
                    timeout_seconds=self.watch_timeout_seconds,
                    **self.list_kwargs,
                ) as stream:
                    async for event in stream:
                        kind, obj = event["type"], event["raw_object"]
                        if kind == "ERROR":
                            break  # usually 410 Gone: relist
                        key = object_key(obj)
                        if kind == "DELETED":
                            self.objects.pop(key, None)
                        else:
                            self.objects[key] = obj
                        await self._emit(kind, obj)
            except asyncio.CancelledError:
                raise
            except (ApiException, OSError, asyncio.TimeoutError, ValueError) as e:
                self.log.warning(
                    "watch of %s failed (%s); relisting in %.1f s",
                    self.list_method.__name__,
                    e,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10)
            except Exception:
                self.log.exception("unexpected error watching %s", self.list_method.__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10)
