"""The node agent runs pods as processes and reports them as a kubelet does."""

from __future__ import annotations

import ipaddress
import json
import sys
import urllib.request
from pathlib import Path

from tests.harness.kube import Kube, container_state, pod_manifest
from tests.harness.wait import wait_for

# serves its environment as JSON on $POD_IP:8080, after writing a marker
ENV_SERVER = r"""
import http.server, json, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""


def field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_pod_with_command_and_env_runs_on_its_pod_ip_and_turns_ready(kube: Kube) -> None:
    name = kube.name("envsrv")
    m = pod_manifest(
        name,
        [sys.executable, "-c", ENV_SERVER],
        env={"GREETING": "hello"},
        workingDir="/tmp",
        readinessProbe={"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
    )
    m["spec"]["containers"][0]["env"] += [
        field_env("POD_IP", "status.podIP"),
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_NAMESPACE", "metadata.namespace"),
        {"name": "WHERE", "value": "$(POD_NAME) on $(POD_IP)"},
    ]
    kube.create_pod(m)
    pod = kube.wait_ready(name)
    status = pod["status"]
    assert status["phase"] == "Running"
    ip = status["podIP"]
    node = kube.node(pod["spec"]["nodeName"])
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(node["spec"]["podCIDR"])
    internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    assert [status["hostIP"]] == internal
    cs = status["containerStatuses"][0]
    assert cs["ready"] is True and "startedAt" in cs["state"]["running"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    served = get_json(f"http://{ip}:8080/")
    env = served["env"]
    assert env["GREETING"] == "hello"
    assert env["POD_IP"] == ip
    assert env["POD_NAME"] == name and env["POD_NAMESPACE"] == "default"
    assert env["WHERE"] == f"{name} on {ip}"
    assert served["cwd"] == "/tmp"


def test_exit_codes_show_as_succeeded_and_failed(kube: Kube) -> None:
    ok, bad = kube.name("ok"), kube.name("bad")
    kube.create_pod(pod_manifest(ok, ["sh", "-c", "echo to-the-log; exit 0"]))
    kube.create_pod(pod_manifest(bad, ["sh", "-c", "exit 3"]))
    done = container_state(kube.wait_phase(ok, "Succeeded"))["terminated"]
    assert kube.cluster.logs(ok) == "to-the-log\n"
    assert (done["exitCode"], done["reason"]) == (0, "Completed")
    failed = container_state(kube.wait_phase(bad, "Failed"))["terminated"]
    assert (failed["exitCode"], failed["reason"]) == (3, "Error")


def test_missing_command_fails_the_pod_with_an_event(kube: Kube) -> None:
    name = kube.name("nocmd")
    kube.create_pod(pod_manifest(name, ["gpulab-no-such-command"]))
    term = container_state(kube.wait_phase(name, "Failed"))["terminated"]
    assert term["reason"] == "StartError"
    assert "gpulab-no-such-command" in term["message"]

    def failed_event() -> list:
        return [e for e in kube.events(name) if e["reason"] == "Failed" and e["type"] == "Warning"]

    event = wait_for("a Failed event", failed_event)[0]
    assert "executable file not found" in event["message"]


def test_a_pause_image_without_command_sleeps_until_stopped(kube: Kube) -> None:
    """A GPU placeholder's container (a pause image, no command) runs as a pause container
    would: it keeps running and ready until deleted (its exit on SIGTERM: test_units); any other
    image without a command still fails to start (the agent knows no other image's entrypoint)."""
    name = kube.name("pause")
    manifest = pod_manifest(name, [], image="registry.k8s.io/pause:3.9", restart="Always")
    del manifest["spec"]["containers"][0]["command"]
    kube.create_pod(manifest)
    pod = kube.wait_ready(name)
    assert "running" in container_state(pod)
    kube.delete_pod(name)
    kube.wait_gone(name)

    other = kube.name("nocmd-image")
    manifest = pod_manifest(other, [], image="python:3.11")
    del manifest["spec"]["containers"][0]["command"]
    kube.create_pod(manifest)
    term = container_state(kube.wait_phase(other, "Failed"))["terminated"]
    assert term["reason"] == "StartError"
    assert "no command" in term["message"]


def test_restart_policy_on_failure_restarts_the_container(kube: Kube, tmp_path: Path) -> None:
    name = kube.name("retry")
    counter = tmp_path / "runs"
    m = pod_manifest(
        name,
        ["sh", "-c", f'echo run >> {counter}; [ "$(wc -l < {counter})" -ge 2 ]'],
        restart="OnFailure",
    )
    kube.create_pod(m)
    pod = kube.wait_phase(name, "Succeeded", timeout=60)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1
    assert counter.read_text().count("run") == 2


def test_pods_get_distinct_loopback_ips_and_serve_http_there(kube: Kube) -> None:
    a, b = kube.name("web"), kube.name("web")
    probe = {"httpGet": {"path": "/", "port": 8000}, "periodSeconds": 1}
    for name, bind in ((a, "$(POD_IP)"), (b, "0.0.0.0")):  # 0.0.0.0 becomes the pod's address
        m = pod_manifest(
            name,
            [sys.executable, "-m", "http.server", "8000", "--bind", bind],
            readinessProbe=probe,
        )
        m["spec"]["containers"][0]["env"].append(field_env("POD_IP", "status.podIP"))
        kube.create_pod(m)
    ips = [kube.wait_ready(n)["status"]["podIP"] for n in (a, b)]
    assert ips[0] != ips[1]
    for ip in ips:
        with urllib.request.urlopen(f"http://{ip}:8000/", timeout=5) as r:
            assert r.status == 200


def test_init_container_runs_before_the_main_container(kube: Kube) -> None:
    name = kube.name("init")
    m = pod_manifest(name, ["sh", "-c", "test -f /gpulab-work/ready"])
    m["spec"]["volumes"] = [{"name": "work", "emptyDir": {}}]
    m["spec"]["containers"][0]["volumeMounts"] = [{"name": "work", "mountPath": "/gpulab-work"}]
    m["spec"]["initContainers"] = [
        {
            "name": "prepare",
            "image": "busybox",
            "command": ["sh", "-c", "touch /gpulab-work/ready"],
            "volumeMounts": [{"name": "work", "mountPath": "/gpulab-work"}],
        }
    ]
    kube.create_pod(m)
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


def test_pod_in_its_own_namespace_sees_that_namespace(kube_ns: Kube) -> None:
    name = kube_ns.name("nspod")
    m = pod_manifest(name, ["sh", "-c", f'test "$NS" = {kube_ns.ns}'])
    m["spec"]["containers"][0]["env"].append(field_env("NS", "metadata.namespace"))
    kube_ns.create_pod(m)
    assert kube_ns.wait_phase(name, "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
