"""Each simulated node serves a kubelet API (logs, exec, attach) that the API server proxies to:
tested through the API server with kubernetes_asyncio (and kubectl where installed), and the
kubelet port itself refusing everyone but the API server (mTLS)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.rest import ApiException
from kubernetes_asyncio.stream import WsApiClient

from gpulab.devcluster import DevCluster
from gpulab.devcluster.agent import crilog
from gpulab.devcluster.agent.kube import api_client
from gpulab.devcluster.pki import KubeletPKI
from tests.harness.kube import Kube, pod_manifest
from tests.harness.wait import wait_for

STAMPED = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z) (.*)$")


@pytest.fixture
async def core(dev_cluster: DevCluster) -> AsyncIterator[client.CoreV1Api]:
    api = await api_client(str(dev_cluster.kubeconfig))
    try:
        yield client.CoreV1Api(api)
    finally:
        await api.close()


@pytest.fixture
async def ws_core(dev_cluster: DevCluster) -> AsyncIterator[client.CoreV1Api]:
    """The API over websockets, as KubeSpawner's tests and kubernetes_asyncio.stream use it."""
    cfg = client.Configuration()
    await config.load_kube_config(str(dev_cluster.kubeconfig), client_configuration=cfg)
    ws = WsApiClient(configuration=cfg)
    try:
        yield client.CoreV1Api(api_client=ws)
    finally:
        await ws.close()


def _running(kube: Kube, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    kube.create_pod(manifest)
    return kube.wait_phase(name, "Running")


def _wait_output(kube: Kube, name: str, lines: int) -> None:
    wait_for(
        f"{lines} lines of output from {name}",
        lambda: len(kube.cluster.logs(name, kube.ns).splitlines()) >= lines,
    )


async def _exec(
    ws_core: client.CoreV1Api,
    kube: Kube,
    name: str,
    command: list[str],
    *,
    stdin: bytes | None = None,
    tty: bool = False,
) -> tuple[bytes, bytes, int]:
    """stdout, stderr and the exit code (from the error channel's Status) of an exec."""
    resp = await ws_core.connect_get_namespaced_pod_exec(
        name,
        kube.ns,
        command=command,
        stdin=stdin is not None,
        stdout=True,
        stderr=True,
        tty=tty,
        _preload_content=False,
    )
    out, err, code = b"", b"", None
    async with resp as ws:
        if stdin is not None:
            await ws.send_bytes(b"\x00" + stdin)
        async for msg in ws:
            channel, data = msg.data[0], msg.data[1:]
            if channel == 1:
                out += data
            elif channel == 2:
                err += data
            elif channel == 3:
                code = WsApiClient.parse_error_data(data)
    assert code is not None, "no Status on the error channel"
    return out, err, code


# -- the CRI log format (no cluster) ------------------------------------------------------------


def test_cri_records_round_trip_long_and_unfinished_lines(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        out, err = crilog.StreamWriter(fd, "stdout"), crilog.StreamWriter(fd, "stderr")
        out.feed(b"first\nsec")  # "sec" waits for the rest of its line
        err.feed(b"oops\n")
        out.feed(b"ond\n" + b"x" * (crilog.MAX_RECORD_BYTES + 5) + b"\nno newline")
        out.close()
    finally:
        os.close(fd)
    data = log.read_bytes()
    recs = list(crilog.records(data))
    assert [(r.stream, r.partial, r.content[:6]) for r in recs] == [
        ("stdout", False, b"first"),
        ("stderr", False, b"oops"),
        ("stdout", False, b"second"),
        ("stdout", True, b"xxxxxx"),
        ("stdout", False, b"xxxxx"),
        ("stdout", False, b"no new"),
    ]
    assert all(STAMPED.match(line.decode()[:35] + " x") for line in data.splitlines())
    long_line = b"x" * (crilog.MAX_RECORD_BYTES + 5) + b"\n"
    assert crilog.plain(data) == b"first\noops\nsecond\n" + long_line + b"no newline\n"
    assert crilog.plain(data[crilog.tail_start(data, 2) :]) == b"xxxxx\nno newline\n"
    # a line not in the format (a launcher's own crash output) is kept as it is
    assert crilog.plain(b"Traceback: boom\n") == b"Traceback: boom\n"
    stamp = crilog.rfc3339_nano(1_700_000_000_120_000_000, trim=True)
    assert stamp == "2023-11-14T22:13:20.12Z"
    assert crilog.parse_time(stamp) == 1_700_000_000_120_000_000


# -- logs ---------------------------------------------------------------------------------------


async def test_pod_log_through_the_api_server_plain_tail_timestamps_and_limit(
    kube_ns: Kube, core: client.CoreV1Api
) -> None:
    name = kube_ns.name("logs")
    script = "echo one; echo two; echo three; echo to-stderr >&2; exec sleep 600"
    await asyncio.to_thread(_running, kube_ns, name, pod_manifest(name, ["sh", "-c", script]))
    await asyncio.to_thread(_wait_output, kube_ns, name, 4)

    async def log(**kw: Any) -> str:
        return str(await core.read_namespaced_pod_log(name, kube_ns.ns, **kw))

    whole = await log()
    # the streams come through two pipes, as with containerd: stdout's own order is kept
    assert [line for line in whole.splitlines() if line != "to-stderr"] == ["one", "two", "three"]
    assert "to-stderr" in whole.splitlines()
    assert (await log(container="main", tail_lines=1)).strip() in ("three", "to-stderr")
    assert await log(limit_bytes=4) in ("one\n", "to-s")
    stamped = (await log(timestamps=True)).splitlines()
    assert len(stamped) == 4
    matches = [STAMPED.match(line) for line in stamped]
    assert all(matches), stamped
    assert [m.group(3) for m in matches if m and m.group(3) != "to-stderr"] == [
        "one",
        "two",
        "three",
    ]
    # sinceSeconds keeps what was written in the last N seconds: all of it within an hour, none
    # of it within the last second once two have passed since the last line
    assert await log(since_seconds=3600) == whole
    newest = max(crilog.parse_time(m.group(1)) for m in matches if m)
    await asyncio.sleep(max(0.0, newest / 1e9 + 2 - time.time()))
    assert await log(since_seconds=1) == ""
    with pytest.raises(ApiException) as e:
        await log(previous=True)
    assert e.value.status == 400
    body = str(e.value.body)
    assert "previous terminated container" in body and name in body, body


async def test_previous_is_the_run_before_the_restart(
    kube_ns: Kube, core: client.CoreV1Api
) -> None:
    name = kube_ns.name("restarts")
    # counts its runs in an emptyDir (which outlives a container restart): the first run fails
    runs = f"/gpulab-test-runs-{name}"
    script = (
        f"n=$(($(cat {runs}/n 2>/dev/null || echo 0) + 1)); echo $n > {runs}/n; echo run-$n; "
        '[ "$n" -ge 2 ] && exec sleep 600; exit 1'
    )
    m = pod_manifest(
        name,
        ["sh", "-c", script],
        restart="OnFailure",
        volumeMounts=[{"name": "runs", "mountPath": runs}],
    )
    m["spec"]["volumes"] = [{"name": "runs", "emptyDir": {}}]
    kube_ns.create_pod(m)

    def restarted_and_running() -> dict[str, Any] | None:
        pod = kube_ns.pod(name) or {}
        cs = (pod.get("status", {}).get("containerStatuses") or [{}])[0]
        return pod if cs.get("restartCount") == 1 and "running" in cs.get("state", {}) else None

    await asyncio.to_thread(wait_for, f"pod {name} restarted once", restarted_and_running, 90)
    assert await core.read_namespaced_pod_log(name, kube_ns.ns) == "run-2\n"
    assert await core.read_namespaced_pod_log(name, kube_ns.ns, previous=True) == "run-1\n"


async def test_follow_yields_a_line_written_after_the_request(
    kube_ns: Kube, core: client.CoreV1Api, ws_core: client.CoreV1Api
) -> None:
    name = kube_ns.name("follow")
    # writes "after" only once the test has created GO/now (by exec, after following)
    go = f"/gpulab-test-go-{name}"
    script = f"echo before; while [ ! -e {go}/now ]; do sleep 0.2; done; echo after"
    m = pod_manifest(
        name,
        ["sh", "-c", script],
        volumeMounts=[{"name": "go", "mountPath": go}],
    )
    m["spec"]["volumes"] = [{"name": "go", "emptyDir": {}}]
    await asyncio.to_thread(_running, kube_ns, name, m)
    resp = await core.read_namespaced_pod_log(name, kube_ns.ns, follow=True, _preload_content=False)
    try:
        assert await asyncio.wait_for(resp.content.readline(), 30) == b"before\n"
        _, _, code = await _exec(ws_core, kube_ns, name, ["touch", f"{go}/now"])
        assert code == 0
        assert await asyncio.wait_for(resp.content.readline(), 30) == b"after\n"
        # the container exited: the stream ends
        assert await asyncio.wait_for(resp.content.read(), 30) == b""
    finally:
        resp.release()


async def test_a_node_stops_with_a_log_follow_open_and_the_follow_ends(
    kube: Kube, core: client.CoreV1Api, dev_cluster: DevCluster
) -> None:
    name = kube.name("follow-stop")
    script = "while true; do echo tick; sleep 0.3; done"
    await asyncio.to_thread(
        _running, kube, name, pod_manifest(name, ["sh", "-c", script], node="gpu-fail")
    )
    resp = await core.read_namespaced_pod_log(name, kube.ns, follow=True, _preload_content=False)
    try:
        assert await asyncio.wait_for(resp.content.readline(), 30) == b"tick\n"
        # the control API answers (a node's stop used to wait for open follows to end)
        await asyncio.to_thread(dev_cluster.stop_node, "gpu-fail")
        try:
            rest = await asyncio.wait_for(resp.content.read(), 30)
        finally:
            await asyncio.to_thread(dev_cluster.start_node, "gpu-fail")
        assert set(rest.split()) <= {b"tick"}
    finally:
        resp.release()
    await asyncio.to_thread(
        wait_for, "gpu-fail Ready again", lambda: kube.node_ready("gpu-fail") == "True", 60
    )


# -- exec ---------------------------------------------------------------------------------------


async def test_exec_streams_stdout_stderr_stdin_and_the_exit_code(
    kube_ns: Kube, ws_core: client.CoreV1Api
) -> None:
    name = kube_ns.name("exec")
    await asyncio.to_thread(_running, kube_ns, name, pod_manifest(name, ["sleep", "600"]))
    out, err, code = await _exec(
        ws_core,
        kube_ns,
        name,
        ["sh", "-c", "read line; echo got:$line; echo oops >&2; exit 7"],
        stdin=b"hello\n",
    )
    assert (out, err, code) == (b"got:hello\n", b"oops\n", 7)
    assert await _exec(ws_core, kube_ns, name, ["true"]) == (b"", b"", 0)
    # the one-shot form KubeSpawner's tests use: stdout and stderr together
    both = await ws_core.connect_get_namespaced_pod_exec(
        name, kube_ns.ns, command=["sh", "-c", "echo a; echo b >&2"], stderr=True, stdout=True
    )
    assert sorted(str(both).split()) == ["a", "b"]
    out, _, code = await _exec(ws_core, kube_ns, name, ["sh", "-c", "tty"], tty=True)
    assert code == 0 and out.startswith(b"/dev/pts/"), out
    # a terminal takes its size from the resize channel (sent before the line stty waits for)
    resp = await ws_core.connect_get_namespaced_pod_exec(
        name,
        kube_ns.ns,
        command=["sh", "-c", "read line; stty size"],
        stdin=True,
        stdout=True,
        tty=True,
        _preload_content=False,
    )
    out = b""
    async with resp as ws:
        await ws.send_bytes(b"\x04" + json.dumps({"Width": 123, "Height": 45}).encode())
        await ws.send_bytes(b"\x00go\r")
        async for msg in ws:
            if msg.data[0] == 1:
                out += msg.data[1:]
    assert out.splitlines()[-1] == b"45 123", out


async def test_an_exec_whose_client_goes_away_is_stopped(
    kube_ns: Kube, ws_core: client.CoreV1Api
) -> None:
    name = kube_ns.name("exec-gone")
    await asyncio.to_thread(_running, kube_ns, name, pod_manifest(name, ["sleep", "600"]))
    resp = await ws_core.connect_get_namespaced_pod_exec(
        name,
        kube_ns.ns,
        command=["sh", "-c", "echo $$; exec sleep 1000"],
        stdout=True,
        stderr=True,
        _preload_content=False,
    )
    async with resp as ws:
        async for msg in ws:
            if msg.data[0] == 1 and msg.data[1:].strip():
                pid = int(msg.data[1:])
                break
    # its PID (in the pod's namespace) is gone once the websocket is closed
    gone = f"while kill -0 {pid} 2>/dev/null; do sleep 0.1; done; echo gone"
    out, _, code = await asyncio.wait_for(_exec(ws_core, kube_ns, name, ["sh", "-c", gone]), 30)
    assert (out, code) == (b"gone\n", 0)


async def test_exec_runs_as_the_pods_user_in_its_mount_and_pid_namespaces(
    kube_ns: Kube, ws_core: client.CoreV1Api
) -> None:
    name = kube_ns.name("exec-as")
    only_here = f"/gpulab-test-only-{name}"
    m = pod_manifest(
        name,
        ["sh", "-c", f"echo in-this-pod-only > {only_here}/file; exec sleep 600"],
        volumeMounts=[{"name": "private", "mountPath": only_here}],
        securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    )
    m["spec"]["volumes"] = [{"name": "private", "emptyDir": {}}]
    m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 2000}
    await asyncio.to_thread(_running, kube_ns, name, m)
    probe = (
        f"while [ ! -s {only_here}/file ]; do sleep 0.1; done; "
        f"id -u; id -g; id -G; cat {only_here}/file; "
        "grep -E '^(NoNewPrivs|CapEff)' /proc/self/status; ls /proc | grep -cE '^[0-9]+$'"
    )
    out, err, code = await _exec(ws_core, kube_ns, name, ["sh", "-c", probe])
    assert code == 0, err
    lines = out.decode().splitlines()
    assert lines[:4] == ["1000", "100", "100 2000", "in-this-pod-only"]
    status = dict(line.split(":\t") for line in lines[4:6])
    assert status == {"CapEff": "0000000000000000", "NoNewPrivs": "1"}
    # its own PID namespace: the pod's PID 1, its command, the exec's shell, grep, ls
    assert int(lines[6]) <= 6
    # the file is in the pod's mount namespace only, not on the machine
    assert not await asyncio.to_thread(os.path.exists, f"{only_here}/file")


async def test_attach_streams_what_the_container_writes_from_then_on(
    kube_ns: Kube, ws_core: client.CoreV1Api
) -> None:
    name = kube_ns.name("attach")
    script = "i=0; while true; do i=$((i+1)); echo tick-$i; echo tock-$i >&2; sleep 0.3; done"
    await asyncio.to_thread(_running, kube_ns, name, pod_manifest(name, ["sh", "-c", script]))
    await asyncio.to_thread(_wait_output, kube_ns, name, 2)
    resp = await ws_core.connect_get_namespaced_pod_attach(
        name, kube_ns.ns, stdout=True, stderr=True, _preload_content=False
    )
    seen: dict[int, list[str]] = {1: [], 2: []}
    async with resp as ws:
        async for msg in ws:
            channel, data = msg.data[0], msg.data[1:]
            if data and channel in seen:
                seen[channel] += data.decode().split()
            if len(seen[1]) >= 2 and len(seen[2]) >= 2:
                break
    # consecutive lines of the running loop, each on its own stream
    ticks = [int(t.removeprefix("tick-")) for t in seen[1]]
    tocks = [int(t.removeprefix("tock-")) for t in seen[2]]
    assert ticks[1] == ticks[0] + 1 and tocks[1] == tocks[0] + 1, seen


# -- who may call the kubelet -------------------------------------------------------------------


def _kubelet_address(kube: Kube, node: str) -> tuple[str, int]:
    status = kube.node(node)["status"]
    ip = next(a["address"] for a in status["addresses"] if a["type"] == "InternalIP")
    return ip, int(status["daemonEndpoints"]["kubeletEndpoint"]["Port"])


def _kubelet_get(address: tuple[str, int], path: str, ctx: ssl.SSLContext) -> str:
    """GET over TLS with `ctx`; the status line, or the TLS/connection error's class."""
    conn = http.client.HTTPSConnection(*address, context=ctx, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return f"{r.status} {r.read().decode(errors='replace')[:80]}"
    except (ssl.SSLError, ConnectionError, OSError) as e:
        return f"refused: {type(e).__name__}"
    finally:
        conn.close()


def test_the_kubelet_port_answers_only_the_api_servers_client_certificate(kube: Kube) -> None:
    pki = KubeletPKI(kube.cluster.state_dir / "secrets" / "kubelet")
    address = _kubelet_address(kube, "gpu-a")
    assert address[1] == 10250

    def context(cert: Any = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
        ctx.check_hostname = False  # the IP SAN is what the API server checks; here the client
        if cert:
            ctx.load_cert_chain(*cert)
        return ctx

    # the serving certificate is the node's, for its InternalIP (hostname checking on)
    strict = ssl.create_default_context(cafile=str(pki.ca_cert))
    strict.load_cert_chain(pki.client_cert, pki.client_key)
    assert _kubelet_get(address, "/healthz", strict) == "200 ok"
    # no client certificate, or another certificate of the same CA (a node's serving one)
    assert _kubelet_get(address, "/healthz", context()).startswith("refused")
    node_pki = kube.cluster.state_dir / "agent" / "pki"
    node_cert = (node_pki / "gpu-a.crt", node_pki / "gpu-a.key")
    assert _kubelet_get(address, "/healthz", context(node_cert)).startswith(("refused", "403"))
    assert _kubelet_get(address, "/containerLogs/default/x/y", context()).startswith("refused")


# a pod's process (runAsUser 1000) tries the kubelet port of its node with no certificate, then
# the API server's client key and the CA key on the node's file system
FROM_A_POD = r"""
import json, os, socket, ssl, sys
ip, port, key, ca_key = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
out = {}
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
try:
    with socket.create_connection((ip, port), timeout=5) as s, ctx.wrap_socket(s) as t:
        t.sendall(f"GET /exec/x/y/z?command=id HTTP/1.1\r\nHost: {ip}\r\n\r\n".encode())
        out["kubelet"] = t.recv(100).decode(errors="replace") or "closed"
except (OSError, ssl.SSLError) as e:
    out["kubelet"] = f"refused: {type(e).__name__}"
for name, path in (("client_key", key), ("ca_key", ca_key)):
    try:
        open(path).read()
        out[name] = "read"
    except OSError as e:
        out[name] = f"error {e.errno}"
print(json.dumps(out), flush=True)
"""


def test_a_pods_process_cannot_use_the_kubelet_api(kube: Kube) -> None:
    pki = KubeletPKI(kube.cluster.state_dir / "secrets" / "kubelet")
    ip, port = _kubelet_address(kube, "gpu-a")
    name = kube.name("kubelet-probe")
    argv = [sys.executable, "-c", FROM_A_POD, ip, str(port), str(pki.client_key), str(pki.ca_key)]
    m = pod_manifest(name, argv, node="gpu-a")
    m["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 100}
    kube.create_pod(m)
    pod = kube.wait_phase(name, "Succeeded", "Failed")
    assert pod["status"]["phase"] == "Succeeded", kube.cluster.logs(name)
    seen = json.loads(kube.cluster.logs(name).strip().splitlines()[-1])
    assert seen["kubelet"].startswith("refused") or seen["kubelet"] == "closed", seen
    assert seen["client_key"] == seen["ca_key"] == "error 13", seen


# -- kubectl --------------------------------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not installed here (these tests install none)",
)
def test_kubectl_logs_and_exec(kube: Kube, tmp_path: Path) -> None:
    name = kube.name("kubectl")
    _running(kube, name, pod_manifest(name, ["sh", "-c", "echo from-the-pod; exec sleep 600"]))
    _wait_output(kube, name, 1)
    # HOME: kubectl's discovery cache goes there
    env = {
        "KUBECONFIG": str(kube.cluster.kubeconfig),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
    }

    def kubectl(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, env=env, timeout=60
        )

    assert kubectl("logs", name).stdout == "from-the-pod\n"
    done = kubectl("exec", "-i", name, "--", "sh", "-c", "cat; exit 4", stdin="piped\n")
    version = kubectl("version", "--client", "-o", "json").stdout
    minor = int(re.sub(r"\D.*", "", json.loads(version)["clientVersion"]["minor"]))
    if minor < 30:  # SPDY only: refused with a message saying to use a websocket client
        assert "websocket" in done.stderr, done.stderr
        return
    assert (done.stdout, done.returncode) == ("piped\n", 4), done.stderr
