"""VolumeSnapshots of gpulab-local volumes: the node agent as snapshotter and CSI driver.

A snapshot of a Bound claim becomes ready with its content, a claim with a snapshot as its
dataSource starts with the snapshot's files, and deleting a snapshot removes its content."""

from __future__ import annotations

import sys
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for

SNAP_API = "/apis/snapshot.storage.k8s.io/v1"


class Snapshots:
    """Claims and VolumeSnapshots of one test; deleted afterwards."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.names: list[str] = []

    def claim(self, name: str, snapshot: str | None = None) -> None:
        spec: dict[str, Any] = {
            "storageClassName": "gpulab-local",
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        }
        if snapshot:
            spec["dataSource"] = {
                "apiGroup": "snapshot.storage.k8s.io",
                "kind": "VolumeSnapshot",
                "name": snapshot,
            }
        self.kube.pvcs.append(name)
        self.kube.api(
            "POST",
            f"/api/v1/namespaces/{self.kube.ns}/persistentvolumeclaims",
            {"metadata": {"name": name}, "spec": spec},
        )

    def pvc(self, name: str) -> dict[str, Any]:
        return self.kube.api(
            "GET", f"/api/v1/namespaces/{self.kube.ns}/persistentvolumeclaims/{name}"
        )

    def wait_bound(self, name: str) -> dict[str, Any]:
        return wait_for(
            f"claim {name} to bind",
            lambda: (p := self.pvc(name)).get("status", {}).get("phase") == "Bound" and p,
        )

    def snapshot(self, name: str, claim: str) -> None:
        self.names.append(name)
        body = {
            "apiVersion": "snapshot.storage.k8s.io/v1",
            "kind": "VolumeSnapshot",
            "metadata": {"name": name},
            "spec": {"source": {"persistentVolumeClaimName": claim}},
        }
        self.kube.api("POST", f"{SNAP_API}/namespaces/{self.kube.ns}/volumesnapshots", body)

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            return self.kube.api(
                "GET", f"{SNAP_API}/namespaces/{self.kube.ns}/volumesnapshots/{name}"
            )
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def content(self, name: str) -> dict[str, Any] | None:
        try:
            return self.kube.api("GET", f"{SNAP_API}/volumesnapshotcontents/{name}")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def wait_ready(self, name: str) -> dict[str, Any]:
        return wait_for(
            f"snapshot {name} to be ready",
            lambda: (s := self.get(name)) and (s.get("status") or {}).get("readyToUse") and s,
        )

    def delete(self, name: str) -> None:
        try:
            self.kube.api("DELETE", f"{SNAP_API}/namespaces/{self.kube.ns}/volumesnapshots/{name}")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise

    def run(self, claim: str, script: str, security: dict[str, Any] | None = None) -> str:
        """Run a Python script in a pod with `claim` mounted at /gpulab-data (with the pod
        securityContext `security`); its output."""
        name = self.kube.name("vol")
        m = pod_manifest(name, [sys.executable, "-c", script])
        if security:
            m["spec"]["securityContext"] = security
        m["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
        m["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/gpulab-data"}]
        self.kube.create_pod(m)
        pod = self.kube.wait_phase(name, "Succeeded", "Failed")
        out = self.kube.cluster.logs(name, self.kube.ns)
        assert pod["status"]["phase"] == "Succeeded", out
        return out


@pytest.fixture
def snaps(kube: Kube) -> Iterator[Snapshots]:
    s = Snapshots(kube)
    yield s
    for name in s.names:
        s.delete(name)


WRITE = """
import os
os.makedirs("/gpulab-data/project", exist_ok=True)
open("/gpulab-data/project/train.py", "w").write("print('epoch 7')\\n")
open("/gpulab-data/weights.bin", "wb").write(bytes(range(256)) * 40)
"""

CHANGE = """
import os
os.remove("/gpulab-data/weights.bin")
open("/gpulab-data/project/train.py", "w").write("broken\\n")
"""

READ = """
import os
for root, dirs, files in sorted(os.walk("/gpulab-data")):
    for f in sorted(files):
        p = os.path.join(root, f)
        print(os.path.relpath(p, "/gpulab-data"), os.path.getsize(p), open(p, "rb").read()[:12])
"""


def test_a_snapshot_of_a_bound_claim_becomes_ready_and_a_claim_from_it_has_its_files(
    kube: Kube, snaps: Snapshots
) -> None:
    source, snap, restored = kube.name("src"), kube.name("snap"), kube.name("restored")
    snaps.claim(source)
    snaps.wait_bound(source)
    snaps.run(source, WRITE)
    before = snaps.run(source, READ)

    snaps.snapshot(snap, source)
    ready = snaps.wait_ready(snap)
    status = ready["status"]
    assert ready["spec"]["volumeSnapshotClassName"] == "gpulab-local"  # the default class
    assert int(status["restoreSize"]) == len("print('epoch 7')\n") + 256 * 40
    assert status["creationTime"].endswith("Z")
    assert ready["metadata"]["annotations"]["snapshot.gpulab.io/files"] == "2"
    content = snaps.content(status["boundVolumeSnapshotContentName"])
    assert content is not None
    assert content["spec"]["driver"] == "gpulab.io/local"
    assert content["spec"]["deletionPolicy"] == "Delete"
    assert content["spec"]["volumeSnapshotRef"]["uid"] == ready["metadata"]["uid"]
    assert content["spec"]["source"]["volumeHandle"] == snaps.pvc(source)["spec"]["volumeName"]
    assert content["status"]["readyToUse"] is True
    assert content["status"]["restoreSize"] == int(status["restoreSize"])

    # later changes to the source leave the snapshot as it was
    snaps.run(source, CHANGE)
    snaps.claim(restored, snapshot=snap)
    pvc = snaps.wait_bound(restored)
    assert pvc["spec"]["dataSource"]["name"] == snap
    assert snaps.run(restored, READ) == before
    assert "broken" in snaps.run(source, READ)


def test_deleting_a_snapshot_removes_its_content_and_its_data(kube: Kube, snaps: Snapshots) -> None:
    source, snap = kube.name("src"), kube.name("snap")
    snaps.claim(source)
    snaps.wait_bound(source)
    snaps.run(source, WRITE)
    snaps.snapshot(snap, source)
    ready = snaps.wait_ready(snap)
    content_name = ready["status"]["boundVolumeSnapshotContentName"]
    handle = snaps.content(content_name)["status"]["snapshotHandle"]
    tree = Path(kube.cluster.state_dir) / "agent" / "snapshots" / handle
    assert (tree / "tree" / "project" / "train.py").read_text() == "print('epoch 7')\n"

    snaps.delete(snap)
    wait_for("the content to be deleted", lambda: snaps.content(content_name) is None)
    wait_for("the snapshot's data to be removed", lambda: not tree.exists())


def test_a_snapshot_waits_for_its_claim_and_a_restore_waits_for_the_snapshot(
    kube: Kube, snaps: Snapshots
) -> None:
    source, snap, restored = kube.name("late"), kube.name("snap"), kube.name("restored")
    snaps.snapshot(snap, source)  # the claim does not exist yet
    snaps.claim(restored, snapshot=snap)

    def error() -> str | None:
        s = snaps.get(snap) or {}
        return ((s.get("status") or {}).get("error") or {}).get("message")

    assert "not found" in wait_for("the snapshot's error", error)
    assert snaps.pvc(restored)["status"]["phase"] == "Pending"
    waiting = wait_for(
        "a WaitingForSnapshot event",
        lambda: [e for e in kube.events(restored) if e["reason"] == "WaitingForSnapshot"],
    )
    assert snap in waiting[0]["message"]

    snaps.claim(source)
    snaps.wait_bound(source)
    snaps.wait_ready(snap)
    assert "error" not in snaps.get(snap)["status"]
    snaps.wait_bound(restored)
    assert snaps.run(restored, READ) == ""  # the snapshot of an empty volume


OWNERS = """
import os
for root, dirs, files in sorted(os.walk("/gpulab-data")):
    for n in sorted(dirs + files):
        st = os.lstat(os.path.join(root, n))
        print(os.path.relpath(os.path.join(root, n), "/gpulab-data"), st.st_uid, oct(st.st_mode & 0o777))
os.chmod("/gpulab-data/private", 0o700)  # only an owner may: the restored files are still its own
"""


def test_a_claim_restored_from_a_snapshot_keeps_its_files_owners(
    kube: Kube, snaps: Snapshots
) -> None:
    source, snap, restored = kube.name("src"), kube.name("snap"), kube.name("restored")
    jovyan = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100}
    snaps.claim(source)
    snaps.wait_bound(source)
    write = (
        "import os; os.makedirs('/gpulab-data/private', mode=0o700); "
        "open('/gpulab-data/private/k', 'w').write('x')"
    )
    snaps.run(source, write, jovyan)
    snaps.snapshot(snap, source)
    snaps.wait_ready(snap)
    snaps.claim(restored, snapshot=snap)
    snaps.wait_bound(restored)
    owners = snaps.run(restored, OWNERS, jovyan).splitlines()
    # the agent (root) copied them twice; uid 1000 still owns them (fsGroup added group rw)
    assert owners == ["private 1000 0o770", "private/k 1000 0o664"]
