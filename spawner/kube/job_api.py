"""The API calls on one attempt's objects: its pods in the hub's pod cache, its Job read and
deleted, its Secret and pods deleted (a 404 is what was wanted), and what an earlier start left.

Apart from the executor in `jobs.py`, which decides when and why to call them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client import BatchV1Api, V1DeleteOptions
from kubernetes_asyncio.client.exceptions import ApiException

from gpulab.spawner.kube.job_records import KubeHandle
from gpulab.spawner.kube.objects import safe_label_value
from gpulab.spawner.names import JOB_RUN_LABEL, USERNAME_LABEL

log = logging.getLogger("gpulab.jobs.kube")

#: the Job controller's label on a Job's pods
JOB_NAME_LABEL = "job-name"


def pods_of(state: Any, h: KubeHandle) -> list[dict[str, Any]]:
    """The attempt's pods in the hub's pod cache, oldest first."""
    found = []
    for pod in list(state.pods.objects.values()):
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if (
            meta.get("namespace") == h.namespace
            and labels.get(JOB_NAME_LABEL) == h.job
            and labels.get(JOB_RUN_LABEL) == str(h.run_id)
        ):
            found.append(pod)
    return sorted(found, key=lambda p: p["metadata"].get("creationTimestamp") or "")


async def read_job(batch: Any, h: KubeHandle) -> dict[str, Any] | None:
    try:
        job = await batch.read_namespaced_job(h.job, h.namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    plain: dict[str, Any] = batch.api_client.sanitize_for_serialization(job)
    return plain


async def delete_job(batch: BatchV1Api, h: KubeHandle, *, grace: int, propagation: str) -> None:
    try:
        await batch.delete_namespaced_job(
            h.job,
            h.namespace,
            body=V1DeleteOptions(grace_period_seconds=grace, propagation_policy=propagation),
        )
    except ApiException as e:
        if e.status != 404:
            raise


async def delete_secret(core: Any, h: KubeHandle) -> None:
    try:
        await core.delete_namespaced_secret(h.secret, h.namespace)
    except ApiException as e:
        if e.status != 404:
            raise


async def delete_pod(core: Any, pod: Mapping[str, Any], *, grace: int) -> None:
    meta = pod["metadata"]
    try:
        await core.delete_namespaced_pod(
            meta["name"], meta["namespace"], body=V1DeleteOptions(grace_period_seconds=grace)
        )
    except ApiException as e:
        if e.status != 404:
            raise


async def job_events(core: Any, h: KubeHandle) -> list[dict[str, Any]]:
    """The core/v1 Events of the attempt's Job (the Job controller's FailedCreate among them)."""
    selector = f"involvedObject.kind=Job,involvedObject.name={h.job}"
    listing = await core.list_namespaced_event(h.namespace, field_selector=selector)
    plain: list[dict[str, Any]] = [
        core.api_client.sanitize_for_serialization(e) for e in listing.items or []
    ]
    return plain


async def delete_leftovers(core: Any, batch: Any, h: KubeHandle) -> None:
    """Jobs of this run's earlier attempts, and a Job or Secret of this very attempt, left by a
    hub that stopped between creating them and storing the handle (the service then retries the
    run without a handle to cancel): they would hold the run's share twice."""
    selector = f"{JOB_RUN_LABEL}={h.run_id},{USERNAME_LABEL}={safe_label_value(h.owner)}"
    listing = await batch.list_namespaced_job(h.namespace, label_selector=selector)
    for job in listing.items or []:
        name = job.metadata.name
        log.warning("job run %d: deleting %s, left by an earlier start", h.run_id, name)
        await delete_job(batch, dataclasses.replace(h, job=name), grace=0, propagation="Background")
    await delete_secret(core, h)


__all__ = [
    "JOB_NAME_LABEL",
    "delete_job",
    "delete_leftovers",
    "delete_pod",
    "delete_secret",
    "job_events",
    "pods_of",
    "read_job",
]
