"""The Secrets of a gpulab Dask cluster on Kubernetes, compared whole (builders in
gpulab.spawner.kube.dask_secrets): the TLS Secret with the cluster's certificate and key, a
worker's GPU report Secret owned by its group, and pods that never carry the key or a token.
"""

from __future__ import annotations

import base64
import json

import pytest

from gpulab.hub.allocator import GPU, GpuShare
from gpulab.spawner.kube.dask_secrets import (
    report_owner_patch,
    report_secret_manifest,
    tls_secret_manifest,
)
from gpulab.spawner.kube.gpu_resources import MIG
from tests.harness.dask_objects import A100, LABELS, SETTINGS, worker_group

CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIGH\n-----END PRIVATE KEY-----\n"

REPORT = {
    "GPULAB_REPORT_URL": "http://hub.gpulab.svc:8002/api/push",
    "GPULAB_REPORT_TOKEN": "a1b2c3d4e5f60718293a4b5c6d7e8f90",
    "GPULAB_REPORT_NAME": "dask-7-w3",
    "GPULAB_REPORT_USER": "alice",
    "GPULAB_PUSH_INTERVAL_SECONDS": "15",
}


def test_the_tls_secret_holds_the_clusters_certificate_and_key_for_its_pods_only() -> None:
    secret = tls_secret_manifest("alice", 7, CERT, KEY, SETTINGS)
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "immutable": True,
        "metadata": {
            "name": "gpulab-dask-alice-7-tls",
            "namespace": "gpulab-alice",
            "labels": LABELS,
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "data": {
            "tls.crt": base64.b64encode(CERT.encode()).decode(),
            "tls.key": base64.b64encode(KEY.encode()).decode(),
        },
    }


def test_a_pod_spec_never_carries_the_key_or_a_service_account_token() -> None:
    body = worker_group(
        MIG, GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"), GpuShare("MIG-2g-0", 250)
    )
    text = json.dumps(body)
    assert "PRIVATE KEY" not in text and "MIGH" not in text
    spec = body["spec"]["worker"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False


def test_a_workers_report_comes_from_its_secret_by_reference_and_no_token_is_in_the_pod() -> None:
    body = worker_group(
        MIG,
        GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"),
        GpuShare("MIG-2g-0", 250),
        tuple(REPORT),
    )
    assert REPORT["GPULAB_REPORT_TOKEN"] not in json.dumps(body)
    (container,) = body["spec"]["worker"]["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    for key in REPORT:
        assert by_name[key] == {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": "gpulab-dask-alice-7-w3-report", "key": key}},
        }
    # without a report (no gpulab-metrics, or no GPU share) the worker has no report variables
    plain = worker_group(
        MIG, GPU("MIG-2g-0", A100, 20480, mig_profile="2g.20gb"), GpuShare("MIG-2g-0", 250)
    )
    (container,) = plain["spec"]["worker"]["spec"]["containers"]
    assert not [e for e in container["env"] if e["name"].startswith("GPULAB_REPORT_")]
    # no Secret is referred to (the pod's address, from the downward API, is no secret)
    assert "secretKeyRef" not in json.dumps(plain)


def test_the_report_secret_holds_the_workers_report_and_is_owned_by_its_group() -> None:
    secret = report_secret_manifest("alice", 7, 3, REPORT, SETTINGS)
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": "gpulab-dask-alice-7-w3-report",
            "namespace": "gpulab-alice",
            "labels": {**LABELS, "gpulab.io/dask-worker": "3"},
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(REPORT.items())},
    }
    group = {"metadata": {"name": "gpulab-dask-alice-7-w3", "uid": "5f1e-77"}}
    assert report_owner_patch(group) == {
        "metadata": {
            "ownerReferences": [
                {
                    "apiVersion": "kubernetes.dask.org/v1",
                    "kind": "DaskWorkerGroup",
                    "name": "gpulab-dask-alice-7-w3",
                    "uid": "5f1e-77",
                }
            ]
        }
    }
    with pytest.raises(ValueError, match="no uid"):
        report_owner_patch({"metadata": {"name": "gpulab-dask-alice-7-w3"}})
