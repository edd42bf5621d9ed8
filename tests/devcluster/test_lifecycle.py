"""Deletion, volumes and node failure, as a kubelet and the control plane handle them."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for

# appends to $LOG: "started", then "sigterm" on SIGTERM; ignores it when $STUBBORN is set
TERM_SCRIPT = r"""
import os, signal, sys, time
log = os.environ["LOG"]
def note(s):
    with open(log, "a") as f: f.write(s + "\n")
def on_term(*_):
    note("sigterm")
    if not os.environ.get("STUBBORN"):
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("started")
while True:
    time.sleep(0.1)
    if os.environ.get("STUBBORN"):
        note("alive")
"""


def hostpath_pod(kube: Kube, name: str, tmp: Path, env: dict[str, str], **container) -> dict:
    m = pod_manifest(name, [sys.executable, "-c", TERM_SCRIPT], env=env, **container)
    m["spec"]["volumes"] = [{"name": "out", "hostPath": {"path": str(tmp), "type": "Directory"}}]
    m["spec"]["containers"][0]["volumeMounts"] = [{"name": "out", "mountPath": "/gpulab-out"}]
    return m


def test_delete_runs_the_prestop_hook_then_sigterm(kube: Kube, tmp_path: Path) -> None:
    name = kube.name("prestop")
    log = tmp_path / "log"
    m = hostpath_pod(
        kube,
        name,
        tmp_path,
        {"LOG": "/gpulab-out/log"},
        lifecycle={
            "preStop": {"exec": {"command": ["sh", "-c", "echo prestop >> /gpulab-out/log"]}}
        },
    )
    kube.create_pod(m)
    kube.wait_phase(name, "Running")
    wait_for("the container to start", lambda: log.exists() and "started" in log.read_text())
    kube.delete_pod(name)
    kube.wait_gone(name)
    assert log.read_text().split() == ["started", "prestop", "sigterm"]


def test_delete_kills_a_process_that_ignores_sigterm_after_the_grace_period(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("stubborn")
    log = tmp_path / "log"
    m = hostpath_pod(kube, name, tmp_path, {"LOG": "/gpulab-out/log", "STUBBORN": "1"})
    m["spec"]["terminationGracePeriodSeconds"] = 2
    kube.create_pod(m)
    wait_for("the container to start", lambda: log.exists() and "alive" in log.read_text())
    kube.delete_pod(name)
    kube.wait_gone(name)
    lines = log.read_text().split()
    assert "sigterm" in lines and lines[-1] == "alive"  # it lived on after SIGTERM...
    size = log.stat().st_size  # the pod is gone only once its process is dead:
    time.sleep(0.5)
    assert log.stat().st_size == size  # ...until it was killed


def test_pvc_binds_and_a_file_written_by_one_pod_is_read_by_the_next(kube: Kube) -> None:
    claim = kube.name("data")
    kube.pvcs.append(claim)
    kube.api(
        "POST",
        "/api/v1/namespaces/default/persistentvolumeclaims",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {
                "storageClassName": "gpulab-local",
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )

    def pvc() -> dict:
        return kube.api("GET", f"/api/v1/namespaces/default/persistentvolumeclaims/{claim}")

    wait_for("the claim to bind", lambda: pvc().get("status", {}).get("phase") == "Bound")
    pv_name = pvc()["spec"]["volumeName"]
    pv = kube.api("GET", f"/api/v1/persistentvolumes/{pv_name}")
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Delete"
    host_dir = Path(pv["spec"]["hostPath"]["path"])

    def with_claim(name: str, script: str) -> dict:
        m = pod_manifest(name, ["sh", "-c", script])
        m["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
        m["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/gpulab-data"}]
        return m

    writer, reader = kube.name("writer"), kube.name("reader")
    kube.create_pod(with_claim(writer, "echo from-writer > /gpulab-data/hello"))
    assert kube.wait_phase(writer, "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    assert (host_dir / "hello").read_text() == "from-writer\n"
    kube.create_pod(with_claim(reader, 'test "$(cat /gpulab-data/hello)" = from-writer'))
    assert kube.wait_phase(reader, "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    for name in (writer, reader):
        kube.delete_pod(name)
        kube.wait_gone(name)
    kube.api("DELETE", f"/api/v1/namespaces/default/persistentvolumeclaims/{claim}")

    def pv_gone() -> bool:
        names = [
            p["metadata"]["name"] for p in kube.api("GET", "/api/v1/persistentvolumes")["items"]
        ]
        return pv_name not in names

    wait_for("the released volume to be deleted", pv_gone)
    assert not host_dir.exists()


def test_configmap_and_secret_volumes_appear_as_files(kube: Kube) -> None:
    cm, secret, name = kube.name("cm"), kube.name("sec"), kube.name("files")
    kube.api(
        "POST",
        "/api/v1/namespaces/default/configmaps",
        {"metadata": {"name": cm}, "data": {"setting": "on"}},
    )
    kube.api(
        "POST",
        "/api/v1/namespaces/default/secrets",
        {"metadata": {"name": secret}, "stringData": {"token": "s3cret"}},
    )
    try:
        m = pod_manifest(
            name,
            ["sh", "-c", 'test "$(cat /gpulab-cfg/setting)$(cat /gpulab-sec/token)" = ons3cret'],
        )
        m["spec"]["volumes"] = [
            {"name": "cfg", "configMap": {"name": cm}},
            {"name": "sec", "secret": {"secretName": secret}},
        ]
        m["spec"]["containers"][0]["volumeMounts"] = [
            {"name": "cfg", "mountPath": "/gpulab-cfg"},
            {"name": "sec", "mountPath": "/gpulab-sec"},
        ]
        kube.create_pod(m)
        assert kube.wait_phase(name, "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    finally:
        kube.api("DELETE", f"/api/v1/namespaces/default/configmaps/{cm}")
        kube.api("DELETE", f"/api/v1/namespaces/default/secrets/{secret}")


def test_a_stopped_node_goes_not_ready_its_pods_are_evicted_and_it_recovers(
    kube: Kube, dev_cluster
) -> None:
    name = kube.name("victim")
    kube.create_pod(pod_manifest(name, ["sleep", "600"], node="gpu-fail"))
    kube.wait_phase(name, "Running")
    dev_cluster.stop_node("gpu-fail")
    try:
        wait_for("gpu-fail to turn NotReady", lambda: kube.node_ready("gpu-fail") != "True", 90)
        taints = [t["key"] for t in kube.node("gpu-fail")["spec"].get("taints", [])]
        assert "node.kubernetes.io/unreachable" in taints
        wait_for(
            "the taint manager to evict the pod",
            lambda: kube.pod(name)["metadata"].get("deletionTimestamp"),
            120,
        )
    finally:
        dev_cluster.start_node("gpu-fail")
    wait_for("gpu-fail to be Ready again", lambda: kube.node_ready("gpu-fail") == "True", 60)

    def untainted() -> bool:
        taints = kube.node("gpu-fail")["spec"].get("taints", [])
        return not any(t["key"].startswith("node.kubernetes.io/") for t in taints)

    wait_for("the failure taints to go", untainted, 60)
    kube.wait_gone(name)  # the returning agent completes the eviction
