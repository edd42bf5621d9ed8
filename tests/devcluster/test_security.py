"""The node agent applies a pod's securityContext: the processes have its uid and groups, the
kubelet's runAsNonRoot refusal, no_new_privs, dropped capabilities, fsGroup-owned volumes; and a
pod reaches another pod's volumes nowhere on the machine's file system."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from tests.harness.kube import Kube, container_state, pod_manifest
from tests.harness.wait import wait_for

# prints what the process is, then what it may read; one JSON line in the container's log
WHO_AM_I = r"""
import json, os, sys
status = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("Cap", "NoNew")))
def readable(path):
    try:
        return open(path).read().strip()
    except OSError as e:
        return f"error {e.errno}"
out = {
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "status": {k: v.strip() for k, v in status.items()},
    "read": {p: readable(p) for p in sys.argv[1:]},
}
print(json.dumps(out), flush=True)
"""

NON_ROOT = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 2000, "supplementalGroups": [3000]}
HARDENED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _who(kube: Kube, name: str) -> dict:
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    assert pod["status"]["phase"] == "Succeeded", kube.cluster.logs(name)
    return json.loads(kube.cluster.logs(name).strip().splitlines()[-1])


def _pod_dir(kube: Kube, pod: dict) -> Path:
    meta = pod["metadata"]
    pods = kube.cluster.state_dir / "agent" / "pods"
    return pods / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def test_processes_run_as_run_as_user_with_fs_group_and_supplemental_groups(kube: Kube) -> None:
    name = kube.name("who")
    m = pod_manifest(name, [sys.executable, "-c", WHO_AM_I], securityContext=HARDENED)
    m["spec"]["securityContext"] = NON_ROOT
    kube.create_pod(m)
    who = _who(kube, name)
    assert (who["uid"], who["euid"], who["gid"]) == (1000, 1000, 100)
    assert who["groups"] == [2000, 3000]  # fsGroup, then supplementalGroups
    assert who["status"]["NoNewPrivs"] == "1"
    assert who["status"]["CapEff"] == who["status"]["CapBnd"] == "0000000000000000"


def test_a_root_container_keeps_no_capability_it_dropped(kube: Kube) -> None:
    name = kube.name("rootcaps")
    m = pod_manifest(name, [sys.executable, "-c", WHO_AM_I], securityContext=HARDENED)
    kube.create_pod(m)
    who = _who(kube, name)
    assert who["uid"] == 0  # no runAsUser: the "image's user", here the agent's account
    assert who["status"]["CapEff"] == who["status"]["CapPrm"] == "0000000000000000"
    assert who["status"]["CapBnd"] == "0000000000000000"


def test_without_allow_privilege_escalation_false_no_new_privs_stays_off(kube: Kube) -> None:
    name = kube.name("nnp")
    m = pod_manifest(name, [sys.executable, "-c", WHO_AM_I])
    m["spec"]["securityContext"] = NON_ROOT
    kube.create_pod(m)
    assert _who(kube, name)["status"]["NoNewPrivs"] == "0"


def test_run_as_non_root_without_a_uid_is_refused_with_the_kubelets_reason(kube: Kube) -> None:
    implicit, explicit = kube.name("asroot"), kube.name("uid0")
    kube.create_pod(pod_manifest(implicit, ["true"], securityContext={"runAsNonRoot": True}))
    zero = pod_manifest(explicit, ["true"], securityContext={"runAsUser": 0})
    zero["spec"]["securityContext"] = {"runAsNonRoot": True}  # the pod's, the container's uid
    kube.create_pod(zero)
    for name, message in (
        (implicit, "container has runAsNonRoot and image will run as root"),
        (explicit, "container's runAsUser breaks non-root policy"),
    ):

        def refused(n: str = name) -> dict | None:
            p = kube.pod(n)
            state = (
                container_state(p) if (p or {}).get("status", {}).get("containerStatuses") else {}
            )
            waiting = state.get("waiting") or {}
            return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

        waiting = wait_for(f"{name} to be refused", refused, 30)
        uid = kube.pod(name)["metadata"]["uid"]
        assert waiting["message"] == f'{message} (pod: "{name}_default({uid})", container: main)'
        assert kube.phase(name) == "Pending"  # never started, as with a kubelet
        events = wait_for(
            "the Failed event",
            lambda n=name: [e for e in kube.events(n) if e["reason"] == "Failed"],
        )
        assert events[0]["message"] == f"Error: {waiting['message']}"


def test_a_pod_cannot_read_a_file_of_another_uid(kube: Kube, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    mine, theirs = shared / "mine.txt", shared / "theirs.txt"
    mine.write_text("own data")
    theirs.write_text("another tenant's data")
    for path, uid in ((mine, 1000), (theirs, 1001)):
        os.chown(path, uid, uid)
        path.chmod(0o600)
    name = kube.name("otheruid")
    m = pod_manifest(
        name,
        [sys.executable, "-c", WHO_AM_I, "/data/mine.txt", "/data/theirs.txt"],
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
    )
    m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000}
    m["spec"]["volumes"] = [{"name": "data", "hostPath": {"path": str(shared)}}]
    kube.create_pod(m)
    read = _who(kube, name)["read"]
    assert read["/data/mine.txt"] == "own data"
    assert read["/data/theirs.txt"] == "error 13"  # EACCES


def test_secret_and_empty_dir_volumes_belong_to_the_fs_group(kube: Kube) -> None:
    secret = kube.name("key")
    kube.api(
        "POST",
        f"/api/v1/namespaces/{kube.ns}/secrets",
        {"metadata": {"name": secret}, "stringData": {"key": "s3cret"}},
    )
    try:
        name = kube.name("fsgroup")
        m = pod_manifest(
            name,
            [
                "sh",
                "-c",
                "stat -c '%a %g' /key/key /scratch && echo written > /scratch/f "
                "&& stat -c '%g' /scratch/f && cat /key/key",
            ],
            volumeMounts=[
                {"name": "key", "mountPath": "/key", "readOnly": True},
                {"name": "scratch", "mountPath": "/scratch"},
            ],
        )
        m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 2000}
        m["spec"]["volumes"] = [
            {"name": "key", "secret": {"secretName": secret, "defaultMode": 0o400}},
            {"name": "scratch", "emptyDir": {}},
        ]
        kube.create_pod(m)
        pod = kube.wait_phase(name, "Succeeded", "Failed")
        assert pod["status"]["phase"] == "Succeeded", kube.cluster.logs(name)
        # 0400 + the kubelet's read-only group mask = 0440; emptyDir setgid 2000: new files too
        assert kube.cluster.logs(name).split("\n")[:4] == [
            "440 2000",
            "2777 2000",
            "2000",
            "s3cret",
        ]
    finally:
        kube.api("DELETE", f"/api/v1/namespaces/{kube.ns}/secrets/{secret}")


def test_another_pod_of_the_same_uid_cannot_reach_a_pods_secret_on_the_host(kube: Kube) -> None:
    secret = kube.name("victim-key")
    kube.api(
        "POST",
        f"/api/v1/namespaces/{kube.ns}/secrets",
        {"metadata": {"name": secret}, "stringData": {"key": "victim's key"}},
    )
    try:
        victim = kube.name("victim")
        m = pod_manifest(
            victim,
            ["sleep", "300"],
            volumeMounts=[{"name": "key", "mountPath": "/key", "readOnly": True}],
        )
        m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100}
        m["spec"]["volumes"] = [{"name": "key", "secret": {"secretName": secret}}]
        kube.create_pod(m)
        pod = kube.wait_ready(victim)
        on_host = _pod_dir(kube, pod) / "volumes" / "key" / "key"
        assert on_host.read_text() == "victim's key"  # the agent (root) wrote it there

        attacker = kube.name("attacker")
        a = pod_manifest(attacker, [sys.executable, "-c", WHO_AM_I, str(on_host), "/key/key"])
        a["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100}
        kube.create_pod(a)
        read = _who(kube, attacker)["read"]
        assert read[str(on_host)] == "error 13"
        # what stops it is the agent's own: its state and pod folders are root's alone
        for folder in (kube.cluster.state_dir, kube.cluster.state_dir / "agent" / "pods"):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        assert read["/key/key"] == "error 2"  # and nothing of the victim is mounted here
    finally:
        kube.api("DELETE", f"/api/v1/namespaces/{kube.ns}/secrets/{secret}")


def test_exec_probes_run_with_the_containers_identity(kube: Kube) -> None:
    name = kube.name("probe")
    check = 'test "$(id -u):$(id -g)" = 1000:100 && grep -q "NoNewPrivs:.*1" /proc/self/status'
    m = pod_manifest(
        name,
        ["sleep", "300"],
        securityContext=HARDENED,
        readinessProbe={"exec": {"command": ["sh", "-c", check]}, "periodSeconds": 1},
    )
    m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100}
    kube.create_pod(m)
    kube.wait_ready(name, timeout=30)


def test_a_command_out_of_the_uids_reach_fails_with_the_folder_that_blocks_it(
    kube: Kube, tmp_path: Path
) -> None:
    script = tmp_path / "tool.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    blocked = next(p for p in [*reversed(script.parents)] if not (p.stat().st_mode & 0o001))
    name = kube.name("noreach")
    m = pod_manifest(name, [str(script)])
    m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100}
    kube.create_pod(m)
    term = container_state(kube.wait_phase(name, "Failed"))["terminated"]
    assert term["reason"] == "StartError"
    assert f"{blocked} (mode drwx" in term["message"]
    assert "is not searchable by uid 1000 gid 100" in term["message"]
    assert "chmod o+x on the parent directories" in term["message"]
