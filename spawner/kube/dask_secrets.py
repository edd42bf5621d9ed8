"""The Secrets of a gpulab Dask cluster, as pure builders: its TLS material and each GPU worker's
report, with the references a worker's container reads them by.

Apart from the pod manifests (`dask_objects`) because these carry the cluster's credentials: what
is in them, who reads them and when they go is said once, here, beside the code that writes them.

TLS. The cluster's `ClusterTLS` (one self-signed certificate that is its own CA) is a Secret of
the owner's namespace, mounted read-only (0440, group fsGroup) into the scheduler and the workers,
and named to distributed by `DASK_DISTRIBUTED__COMM__*` variables (paths, not the key): the
scheduler requires mutual TLS, so a pod that reaches its port without the key cannot connect.
Only the hub (its service account) and the cluster's own pods read the Secret; the owner gets
the same material from the hub's REST API.

GPU report. A worker holding a GPU share gets the hub's report for it (`gpulab.hub.report_tokens`:
the push URL, a token worth only reporting for that worker, its name and owner) from a Secret of
its own (`report_secret_manifest`, `<cluster>-w<n>-report`), through `valueFrom.secretKeyRef`:
the token is never a literal of the DaskWorkerGroup or its pod, which the operator copies into a
Deployment and whose specs more people and controllers read than the Secret. The Secret is
owned by the worker group once it exists (`report_owner_patch`: the garbage collector deletes it
with the group) and deleted by the executor with the worker's pods; the token itself is revoked
when the worker's share is given back.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

from gpulab.spawner.kube.dask_settings import (
    DASK_API,
    TLS_CERT_KEY,
    TLS_KEY_KEY,
    KubeDaskSettings,
    cluster_name,
    dask_labels,
    report_secret_name,
    tls_secret_name,
)
from gpulab.spawner.names import USERNAME_LABEL


def tls_secret_manifest(
    owner: str, cluster_id: int, cert_pem: str, key_pem: str, settings: KubeDaskSettings
) -> dict[str, Any]:
    """The cluster's TLS Secret (kubernetes.io/tls, immutable) in the owner's namespace."""
    name = cluster_name(owner, cluster_id)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "immutable": True,
        "metadata": {
            "name": tls_secret_name(name),
            "namespace": settings.namespace,
            "labels": dask_labels(owner, cluster_id, settings.labels),
            "annotations": {USERNAME_LABEL: owner},
        },
        "data": {
            TLS_CERT_KEY: base64.b64encode(cert_pem.encode()).decode(),
            TLS_KEY_KEY: base64.b64encode(key_pem.encode()).decode(),
        },
    }


def report_secret_manifest(
    owner: str,
    cluster_id: int,
    number: int,
    report: Mapping[str, str],
    settings: KubeDaskSettings,
) -> dict[str, Any]:
    """Worker `number`'s GPU report (Opaque, immutable), one key per variable, in the owner's
    namespace. As with the TLS Secret, only the hub (its service account) and the pod that
    references it read it: users hold no Kubernetes permission (their pods mount no service
    account token), and every pod spec is the hub's, naming only its own workload's Secrets.
    Create it before the worker group (its pod needs it to start), then `report_owner_patch`
    once the group exists."""
    name = cluster_name(owner, cluster_id)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": report_secret_name(name, number),
            "namespace": settings.namespace,
            "labels": dask_labels(owner, cluster_id, settings.labels, worker=number),
            "annotations": {USERNAME_LABEL: owner},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(report.items())},
    }


def report_environment(secret_name: str, keys: Sequence[str]) -> list[dict[str, Any]]:
    """The worker container's report variables, each a reference to its key of the report's
    Secret, never its value (see the module docstring)."""
    return [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": k}}}
        for k in sorted(keys)
    ]


def report_owner_patch(group: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that makes the created worker `group` (with its uid) the owner of its
    report's Secret, so the garbage collector deletes the Secret with the group."""
    meta = group["metadata"]
    if not meta.get("uid"):
        raise ValueError(f"DaskWorkerGroup {meta.get('name')!r} has no uid: patch it once made")
    reference = {
        "apiVersion": DASK_API,
        "kind": "DaskWorkerGroup",
        "name": meta["name"],
        "uid": meta["uid"],
    }
    return {"metadata": {"ownerReferences": [reference]}}


__all__ = [
    "report_environment",
    "report_owner_patch",
    "report_secret_manifest",
    "tls_secret_manifest",
]
