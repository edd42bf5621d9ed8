"""Native sidecars (init containers with restartPolicy Always) on the node agent, as a 1.37
kubelet runs them: started before the main containers, restarted whatever the pod's policy,
stopped after the main containers, in reverse order, when a Job's pod completes or is deleted."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for

# a container named argv[1]: appends its name to /gpulab-out/started when it starts and to
# /gpulab-out/stopped on SIGTERM (then exits 0 after a short while, or dies of the signal when
# an argument says "die", as a process without a handler would: 143); further arguments only
# mark its command line
RECORDER = r"""
import os, signal, sys, time
name = sys.argv[1]
def note(what):
    with open("/gpulab-out/" + what, "a") as f: f.write(name + "\n")
def on_term(*_):
    note("stopped")
    time.sleep(0.5)  # a container still busy stopping: whatever waits for it must wait
    if "die" in sys.argv[2:]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("started")
while True:
    time.sleep(0.1)
"""

# serves "from-the-sidecar" on the pod's port 9000, after a slow start (its startup probe passes
# only then)
SLOW_SERVER = r"""
import http.server, time
time.sleep(2)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"from-the-sidecar")
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", 9000), H).serve_forever()
"""

# the main container: one request to the sidecar over the pod's loopback (exits 1 if it is not
# there yet), then keeps running
FETCH_ONCE = r"""
import time, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:9000/", timeout=5).read().decode(), flush=True)
while True:
    time.sleep(1)
"""


def recorder(name: str, *extra: str) -> list[str]:
    return [sys.executable, "-c", RECORDER, name, *extra]


def sidecar(name: str, command: list[str], **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": "busybox",
        "command": command,
        "restartPolicy": "Always",
        "volumeMounts": [{"name": "out", "mountPath": "/gpulab-out"}],
        **fields,
    }


def pod_with_sidecars(
    name: str, main: list[str], sidecars: list[dict[str, Any]], out: Path, **pod: Any
) -> dict[str, Any]:
    """A pod whose main container runs `main`, with `sidecars` as its init containers; every
    container has the test's folder `out` at /gpulab-out (a hostPath: the test reads it)."""
    m = pod_manifest(name, main, **pod)
    m["spec"]["volumes"] = [{"name": "out", "hostPath": {"path": str(out), "type": "Directory"}}]
    m["spec"]["containers"][0]["volumeMounts"] = [{"name": "out", "mountPath": "/gpulab-out"}]
    m["spec"]["initContainers"] = sidecars
    return m


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def init_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in pod["status"]["initContainerStatuses"] if s["name"] == name)


def conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in pod["status"]["conditions"]}


def processes_naming(token: str) -> list[int]:
    """This machine's processes whose command line contains token (a container's own argument)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(entry))
    return found


def test_a_sidecar_starts_before_the_main_container_and_keeps_running(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar")
    server = sidecar(
        "server",
        [sys.executable, "-c", SLOW_SERVER],
        startupProbe={"tcpSocket": {"port": 9000}, "periodSeconds": 1, "failureThreshold": 30},
        readinessProbe={"httpGet": {"path": "/", "port": 9000}, "periodSeconds": 1},
    )
    kube.create_pod(pod_with_sidecars(name, [sys.executable, "-c", FETCH_ONCE], [server], tmp_path))
    pod = kube.wait_ready(name)
    # the main container's one request found the sidecar serving: the agent waited for the
    # sidecar's startup probe, not for its exit (it never exits). Ready says the main container
    # runs, not that its Python has made the request yet (CI on a loaded machine read the log
    # empty), so its first line is waited for
    main_log = wait_for(
        "the main container's first line",
        lambda: kube.cluster.logs(name, container="main"),
        30,
    )
    assert main_log == "from-the-sidecar\n"
    status = pod["status"]
    assert status["phase"] == "Running"
    side = init_status(pod, "server")
    assert (side["started"], side["ready"], side["restartCount"]) == (True, True, 0)
    assert "running" in side["state"]
    main = status["containerStatuses"][0]
    assert main["state"]["running"]["startedAt"] >= side["state"]["running"]["startedAt"]
    conds = conditions(pod)
    assert conds["Initialized"]["status"] == "True"
    assert conds["ContainersReady"]["status"] == "True"


def test_a_pod_waits_for_its_sidecars_startup_probe_and_says_so(kube: Kube, tmp_path: Path) -> None:
    name = kube.name("sidecar-wait")
    never = sidecar(
        "proxy",
        recorder("proxy"),
        startupProbe={"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 60},
    )
    kube.create_pod(pod_with_sidecars(name, recorder("main"), [never], tmp_path))

    def initializing() -> dict[str, Any] | None:
        pod = kube.pod(name)
        side = pod and (pod["status"].get("initContainerStatuses") or [{}])[0]
        return pod if side and "running" in side.get("state", {}) else None

    wait_for("the sidecar to run", initializing, 60)
    time.sleep(3)  # a few failed startup probes
    pod = kube.pod(name)
    assert pod is not None
    assert pod["status"]["phase"] == "Pending"
    assert init_status(pod, "proxy")["started"] is False
    initialized = conditions(pod)["Initialized"]
    assert initialized["status"] == "False"
    assert initialized["message"] == "containers with incomplete status: [proxy]"
    assert lines(tmp_path / "started") == ["proxy"]  # the main container never started


def test_a_jobs_pod_succeeds_when_its_main_container_exits_and_its_sidecar_is_stopped(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar-job")
    token = f"gpulab-test-{name}"
    main = ["sh", "-c", "sleep 1; echo main >> /gpulab-out/stopped"]  # its last word, then exit 0
    log = sidecar("log", recorder("log", "die", token))  # stopped by SIGTERM: exit 143
    kube.create_pod(pod_with_sidecars(name, main, [log], tmp_path, restart="Never"))
    pod = kube.wait_phase(name, "Succeeded", "Failed", timeout=60)
    assert lines(tmp_path / "started") == ["log"]
    # the phase is the main container's; the sidecar's exit by SIGTERM does not fail the pod
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    side = init_status(pod, "log")["state"]["terminated"]
    assert side["exitCode"] == 143
    assert (
        side["finishedAt"]
        >= pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"]
    )
    # stopped after the main container exited, and gone when the pod was reported Succeeded
    assert lines(tmp_path / "stopped") == ["main", "log"]
    assert processes_naming(token) == []


def test_a_sidecar_that_exits_is_restarted_in_a_never_restart_pod(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar-restart")
    flaky = sidecar("flaky", ["sh", "-c", "echo run >> /gpulab-out/runs; sleep 1"])
    kube.create_pod(pod_with_sidecars(name, recorder("main"), [flaky], tmp_path, restart="Never"))

    # back-off as for any container: 10 s, then 20 s
    wait_for("the sidecar's third run", lambda: len(lines(tmp_path / "runs")) >= 3, 90)
    pod = kube.pod(name)
    assert pod is not None
    assert pod["status"]["phase"] == "Running"
    assert conditions(pod)["Initialized"]["status"] == "True"
    side = init_status(pod, "flaky")
    assert side["restartCount"] >= 2
    assert side["lastState"]["terminated"]["exitCode"] == 0  # exit 0 is restarted too
    main = pod["status"]["containerStatuses"][0]
    assert main["restartCount"] == 0 and "running" in main["state"]
    assert lines(tmp_path / "started") == ["main"]  # the main container ran on throughout


def test_a_sidecars_readiness_counts_in_the_pods_ready_condition(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar-unready")
    unready = sidecar(
        "proxy",
        recorder("proxy"),
        readinessProbe={"exec": {"command": ["false"]}, "periodSeconds": 1},
    )
    kube.create_pod(pod_with_sidecars(name, recorder("main"), [unready], tmp_path))
    pod = kube.wait_phase(name, "Running")
    wait_for("both to run", lambda: lines(tmp_path / "started") == ["proxy", "main"], 30)
    pod = kube.pod(name) or pod
    assert init_status(pod, "proxy")["started"] is True
    assert init_status(pod, "proxy")["ready"] is False
    assert pod["status"]["containerStatuses"][0]["ready"] is True
    ready = conditions(pod)["Ready"]
    assert ready["status"] == "False"
    assert ready["message"] == "containers with unready status: [proxy]"


def test_deletion_stops_the_main_container_first_then_the_sidecars_in_reverse_order(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar-delete")
    first, second = sidecar("first", recorder("first")), sidecar("second", recorder("second"))
    kube.create_pod(
        pod_with_sidecars(name, recorder("main"), [first, second], tmp_path, restart="Always")
    )
    kube.wait_ready(name)
    assert lines(tmp_path / "started") == ["first", "second", "main"]
    kube.delete_pod(name, grace=20)
    kube.wait_gone(name)
    # each waits for the one before to have exited (0.5 s after its SIGTERM), not just signalled
    assert lines(tmp_path / "stopped") == ["main", "second", "first"]


def test_a_failed_init_container_after_a_sidecar_fails_the_pod_and_stops_the_sidecar(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar-initfail")
    failing = {"name": "prepare", "image": "busybox", "command": ["sh", "-c", "exit 3"]}
    m = pod_with_sidecars(
        name, recorder("main"), [sidecar("proxy", recorder("proxy")), failing], tmp_path
    )
    kube.create_pod(m)
    pod = kube.wait_phase(name, "Failed", "Succeeded", timeout=60)
    assert pod["status"]["phase"] == "Failed"
    assert init_status(pod, "prepare")["state"]["terminated"]["exitCode"] == 3
    assert "terminated" in init_status(pod, "proxy")["state"]
    assert lines(tmp_path / "started") == ["proxy"] and lines(tmp_path / "stopped") == ["proxy"]


def test_after_a_node_restart_the_sidecar_runs_again_before_main_and_init_stays_done(
    kube: Kube, dev_cluster, tmp_path: Path
) -> None:
    name = kube.name("sidecar-resume")
    prepare = {
        "name": "prepare",
        "image": "busybox",
        "command": ["sh", "-c", "echo prepare >> /gpulab-out/started"],
        "volumeMounts": [{"name": "out", "mountPath": "/gpulab-out"}],
    }
    m = pod_with_sidecars(
        name,
        recorder("main"),
        [sidecar("proxy", recorder("proxy")), prepare],
        tmp_path,
        restart="Always",
        node="gpu-fail",
    )
    kube.create_pod(m)
    kube.wait_ready(name)
    dev_cluster.stop_node("gpu-fail")  # the pod's processes die with the node's agent
    dev_cluster.start_node("gpu-fail")

    def resumed() -> dict[str, Any] | None:
        pod = kube.pod(name)
        main = pod and pod["status"]["containerStatuses"][0]
        return pod if main and main["restartCount"] == 1 and main["ready"] else None

    pod = wait_for("the pod's containers to run again", resumed, 90)
    # the regular init container is not run again; the sidecar is, before the main container
    assert lines(tmp_path / "started") == ["proxy", "prepare", "main", "proxy", "main"]
    side = init_status(pod, "proxy")
    assert side["restartCount"] == 1 and side["started"] is True and "running" in side["state"]
    assert init_status(pod, "prepare")["state"]["terminated"]["exitCode"] == 0
    assert conditions(pod)["Ready"]["status"] == "True"


def test_a_sidecar_failing_its_startup_probe_is_killed_and_restarted(
    kube: Kube, tmp_path: Path
) -> None:
    name = kube.name("sidecar-startfail")
    never = sidecar(
        "proxy",
        recorder("proxy"),
        startupProbe={"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2},
    )
    m = pod_with_sidecars(name, recorder("main"), [never], tmp_path, restart="Never")
    m["spec"]["terminationGracePeriodSeconds"] = 5
    kube.create_pod(m)
    wait_for("the sidecar to be stopped", lambda: lines(tmp_path / "stopped") == ["proxy"], 60)

    # run again after the back-off (10 s), and still the main container waits for it
    wait_for("the sidecar's second run", lambda: lines(tmp_path / "started") == ["proxy"] * 2, 40)
    pod = kube.pod(name)
    assert pod is not None
    assert init_status(pod, "proxy")["restartCount"] >= 1
    assert pod["status"]["phase"] == "Pending"  # a Never pod, yet the sidecar is restarted
    assert "Unhealthy" in {e["reason"] for e in kube.events(name)}
