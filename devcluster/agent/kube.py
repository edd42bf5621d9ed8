"""Kubernetes API plumbing shared by the agent's parts: client, dict responses, watches, events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.rest import ApiException

log = logging.getLogger("gpulab.devcluster.agent")

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def api_client(kubeconfig: str, *, connections: int = 100) -> client.ApiClient:
    """A kubernetes_asyncio client for a kubeconfig; `connections` bounds its pool (each watch
    holds one connection for as long as it runs)."""
    cfg = client.Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = connections
    return client.ApiClient(configuration=cfg)


async def raw(call: Awaitable[Any]) -> dict[str, Any]:
    """The JSON body of a call made with _preload_content=False; ApiException unless 2xx.

    (kubernetes_asyncio checks the status only when it deserialises the response itself.)
    """
    resp = await call
    try:
        if not 200 <= resp.status < 300:
            text = await resp.text()
            e = ApiException(status=resp.status, reason=resp.reason)
            e.body = text
            raise e
        return dict(await resp.json())
    finally:
        resp.release()


def status_of(e: BaseException) -> int | None:
    return e.status if isinstance(e, ApiException) else None


async def watch_forever(
    what: str,
    list_call: Callable[..., Awaitable[Any]],
    handle: Callable[[str, dict[str, Any]], Awaitable[None]],
    *,
    resync: Callable[[list[dict[str, Any]]], Awaitable[None]] | None = None,
    **kwargs: Any,
) -> None:
    """List, then watch from that resourceVersion; relist after any error (410 Gone included).

    handle(event_type, object_dict) gets ADDED for every listed object too.
    """
    while True:
        try:
            listing = await raw(list_call(_preload_content=False, **kwargs))
            items = listing.get("items", [])
            if resync:
                await resync(items)
            for item in items:
                await handle("ADDED", item)
            rv = listing["metadata"]["resourceVersion"]
            w = watch.Watch()
            async with w.stream(
                list_call,
                resource_version=rv,
                timeout_seconds=240,  # ends before aiohttp's 300 s request timeout
                allow_watch_bookmarks=True,
                **kwargs,
            ) as stream:
                async for event in stream:
                    if event["type"] == "BOOKMARK":
                        continue
                    await handle(event["type"], event["raw_object"])
        except asyncio.CancelledError:
            raise
        except ApiException as e:
            if e.status != 410:
                log.warning("watch %s: %s %s; relisting", what, e.status, e.reason)
            await asyncio.sleep(0.5)
        except Exception as e:  # network trouble, API restart: keep the agent alive
            log.warning("watch %s failed (%s: %s); relisting", what, type(e).__name__, e)
            await asyncio.sleep(1)


class Events:
    """Writes core/v1 Events as a kubelet does (source.component=kubelet, source.host=node)."""

    def __init__(self, core: client.CoreV1Api) -> None:
        self.core = core

    async def emit(
        self,
        obj: dict[str, Any],
        reason: str,
        message: str,
        *,
        type_: str = "Normal",
        host: str | None = None,
        component: str = "kubelet",
        field_path: str | None = None,
        kind: str = "Pod",
    ) -> None:
        meta = obj["metadata"]
        ns = meta.get("namespace") or "default"
        ref = {
            "apiVersion": obj.get("apiVersion") or "v1",
            "kind": obj.get("kind") or kind,
            "name": meta["name"],
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        }
        if field_path:
            ref["fieldPath"] = field_path
        ts = now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": ns},
            "involvedObject": ref,
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": component, **({"host": host} if host else {})},
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
            "reportingComponent": component,
            "reportingInstance": host or component,
        }
        with contextlib.suppress(Exception):
            await raw(self.core.create_namespaced_event(ns, body, _preload_content=False))
        log.info("event %s/%s %s: %s", ns, meta["name"], reason, message)
