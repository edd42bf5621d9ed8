"""The cross-user attack catalogue: what user code and a user's token try against another user and
the hub, run by tests/spawner/local/test_isolation.py (which asserts that every attempt is refused) and by
`python -m bench.isolation` (which prints the table).

An attempt ends as one of
- refused: the operating system said no (PermissionError) or the hub/server answered 4xx;
- leak: it worked (a file was read, a signal delivered, a 2xx answer with another user's data);
- server_error: a 5xx answer (gpulab must refuse bad input with a 4xx, never fail on it).

The attacker is "mallory", a normal user with her own server; the victim is "victor", who has a
server, a file, a kernel checkpoint, snapshots and a running kernel. Every attempt is the strongest
form we can give it: the attacker is handed the victim's paths, pids and kernel id.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClosedError, websocket_connect

from gpulab.devcluster import DevCluster
from gpulab.hub.metrics_names import PUSH_URL_ENV
from gpulab.spawner.workspaces.kube import KEY_FILE as CHECKPOINT_KEY_FILE
from tests.harness.hub import Hub, run_in_kernel

ATTACKER, VICTIM = "mallory", "victor"


@dataclass(frozen=True)
class Attempt:
    category: str
    name: str
    outcome: str  # refused | leak | server_error
    detail: str = ""


def _http_outcome(status: int) -> str:
    if status >= 500:
        return "server_error"
    return "refused" if 400 <= status < 500 else "leak"


# Runs in the attacker's kernel: each read/list/signal, reported as allowed/denied/missing.
# The start of every kernel probe: each read of READS and listing of LISTINGS, reported as
# allowed/denied/missing (or the error's name), into `results`.
PROBE_READS = """
import json, os, socket
def attempt(fn):
    try:
        fn()
        return "allowed"
    except PermissionError:
        return "denied"
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return type(e).__name__
def read(path):
    return lambda: open(path, "rb").read(1)
results = {}
for name, path in READS.items():
    results[name] = attempt(read(path))
for name, path in LISTINGS.items():
    results[name] = attempt(lambda: os.listdir(path))
"""

KERNEL_PROBE = (
    PROBE_READS
    + """
for name, pid in PIDS.items():
    results["environ of " + name] = attempt(read(f"/proc/{pid}/environ"))
    results["signal " + name] = attempt(lambda: os.kill(pid, 0))
print(json.dumps(results))
"""
)


async def prepare_victim(hub: Hub, profile: str | None = None) -> dict[str, Any]:
    """Both users exist and run servers (of `profile`, else the default one); the victim leaves a
    file, a checkpoint and a snapshot."""
    for user in (ATTACKER, VICTIM):
        hub.create_user(user)
        hub.start_server(user, profile=profile)
    await run_in_kernel(hub, VICTIM, "open('diary.txt', 'w').write('private')\nsecret = 42")
    hub.stop_server(VICTIM)  # the final checkpoint and an on-stop snapshot
    hub.start_server(VICTIM, profile=profile)
    tokens = {
        user: hub.api("POST", f"/users/{user}/tokens", json={"note": "attack"}).json()["token"]
        for user in (ATTACKER, VICTIM)
    }
    snapshots = hub.api("GET", f"/gpulab/users/{VICTIM}/snapshots").json()["snapshots"]
    return {"tokens": tokens, "snapshot": snapshots[0]["id"]}


async def kernel_attacks(hub: Hub) -> list[Attempt]:
    """From inside the attacker's kernel: the victim's files and processes, the hub's state."""
    state = hub.state_dir
    home = hub.home(VICTIM)
    victim_env = hub.server_env(VICTIM)
    reads = {
        "victim's file": str(home / "diary.txt"),
        "victim's checkpoint": str(
            next((home / ".gpulab" / "checkpoints").rglob("manifest.json"), "no checkpoint")
        ),
        "victim's key file": victim_env["GPULAB_CHECKPOINT_KEY_FILE"],
        "victim's snapshot": str(next((state / "snapshots" / VICTIM / "default").iterdir())),
        "hub database": str(state / "jupyterhub.sqlite"),
        "hub cookie secret": str(state / "jupyterhub_cookie_secret"),
        "hub checkpoint secret": str(state / "gpulab-checkpoint-secret"),
        "allocations database": str(state / "gpulab-allocations.sqlite"),
        "initial admin password": str(state / "initial-admin-password"),
    }
    missing = [name for name, path in reads.items() if not Path(path).exists()]
    assert not missing, f"the probe's targets must exist to prove anything: {missing}"
    listings = {
        "list the victim's home": str(home),
        "list all homes": str(state / "homes"),
        "list the hub's state": str(state),
    }
    pids = {"the victim's server": hub.server_pid(VICTIM)}
    if hub.proc is not None:
        pids["the hub"] = hub.proc.pid
    code = f"READS = {reads!r}\nLISTINGS = {listings!r}\nPIDS = {pids!r}\n" + KERNEL_PROBE
    out = await run_in_kernel(hub, ATTACKER, code)
    results = json.loads(out.splitlines()[-1])
    category = {
        **dict.fromkeys(["victim's file", "victim's checkpoint", "victim's key file"], "files"),
        "victim's snapshot": "files",
        "list the victim's home": "files",
        "list all homes": "files",
    }
    attempts = []
    for name, result in results.items():
        cat = category.get(name) or (
            "processes" if name.split()[0] in ("environ", "signal") else "hub secrets"
        )
        attempts.append(Attempt(cat, name, "refused" if result == "denied" else "leak", result))
    return attempts


async def deputy_attacks(
    hub: Hub,
    target: Path | None = None,
    snapshot_root: Path | None = None,
    profile: str | None = None,
) -> list[Attempt]:
    """The attacker links a root-only file (`target`, default the hub's cookie secret) into her
    home and has the hub (or, on Kubernetes, the node's snapshotter) snapshot and restore it: what
    the link points at must never be copied (`snapshot_root`: where the snapshot trees lie,
    default the local hub's `snapshots/<attacker>`)."""
    cookie = target or hub.state_dir / "jupyterhub_cookie_secret"
    assert cookie.is_file(), f"the link's target must exist to prove anything: {cookie}"
    await run_in_kernel(hub, ATTACKER, f"import os\nos.symlink({str(cookie)!r}, 'loot')")
    hub.stop_server(ATTACKER)
    snaps = hub.api("GET", f"/gpulab/users/{ATTACKER}/snapshots").json()["snapshots"]
    r = hub.api("POST", f"/gpulab/users/{ATTACKER}/snapshots/{snaps[0]['id']}/restore")
    assert r.status_code == 200, r.text  # a refused restore would prove nothing
    hub.start_server(ATTACKER, profile=profile)
    probe = (
        "try:\n    data = open('loot', 'rb').read()\n    print('read', len(data))\n"
        "except PermissionError:\n    print('denied')"
    )
    out = (await run_in_kernel(hub, ATTACKER, probe)).splitlines()[-1]
    root = snapshot_root or hub.state_dir / "snapshots" / ATTACKER
    stored = list(root.rglob("loot"))
    assert stored, f"the snapshot must hold the link to prove anything: none under {root}"
    copied = [p for p in stored if not p.is_symlink()]
    return [
        Attempt(
            "confused deputy",
            "read the cookie secret via a restored link",
            "refused" if out == "denied" else "leak",
            out,
        ),
        Attempt(
            "confused deputy",
            "snapshot copies what a link points at",
            "leak" if copied else "refused",
            f"{len(stored)} stored, {len(copied)} copied",
        ),
    ]


async def api_attacks(hub: Hub, victim: dict[str, Any]) -> list[Attempt]:
    """The attacker's own token against the victim's resources on the hub and her server."""
    token = victim["tokens"][ATTACKER]
    snap = victim["snapshot"]
    api = f"{hub.url}/hub/api"
    requests: list[tuple[str, str, str, Any]] = [
        ("rest", "list the victim's snapshots", "GET", f"{api}/gpulab/users/{VICTIM}/snapshots"),
        ("rest", "snapshot the victim's server", "POST", f"{api}/gpulab/users/{VICTIM}/snapshots"),
        (
            "rest",
            "restore the victim's snapshot",
            "POST",
            f"{api}/gpulab/users/{VICTIM}/snapshots/{snap}/restore",
        ),
        (
            "rest",
            "clone the victim's snapshot",
            "POST",
            f"{api}/gpulab/users/{VICTIM}/snapshots/{snap}/clone",
        ),
        ("rest", "list every allocation", "GET", f"{api}/gpulab/allocations"),
        ("rest", "read the victim's user model", "GET", f"{api}/users/{VICTIM}"),
        ("rest", "start a server as the victim", "POST", f"{api}/users/{VICTIM}/servers/x"),
        ("rest", "stop the victim's server", "DELETE", f"{api}/users/{VICTIM}/server"),
        ("rest", "make a token for the victim", "POST", f"{api}/users/{VICTIM}/tokens"),
        (
            "server",
            "read the victim's files through her server",
            "GET",
            f"{hub.url}/user/{VICTIM}/api/contents/diary.txt",
        ),
        ("server", "list the victim's kernels", "GET", f"{hub.url}/user/{VICTIM}/api/kernels"),
        (
            "metrics",
            "read the metrics service's admin API",
            "GET",
            f"{hub.url}/services/gpulab-metrics/api/servers",
        ),
    ]
    attempts = []
    async with httpx.AsyncClient(headers={"Authorization": f"token {token}"}, timeout=30) as client:
        for category, name, method, url in requests:
            body = {"name": "stolen"} if name.startswith("clone") else None
            r = await client.request(method, url, json=body)
            attempts.append(
                Attempt(category, name, _http_outcome(r.status_code), str(r.status_code))
            )
        # the victim's kernel, by id (the strongest case: the attacker somehow learnt it)
        r = await client.post(
            f"{hub.url}/user/{VICTIM}/api/kernels",
            headers={"Authorization": f"token {victim['tokens'][VICTIM]}"},
            json={"name": "python3"},
        )
        kernel = r.json()["id"]
        ws_url = f"{hub.url}/user/{VICTIM}/api/kernels/{kernel}/channels".replace(
            "http://", "ws://"
        )
        try:
            ws = await websocket_connect(
                HTTPRequest(ws_url, headers={"Authorization": f"token {token}"})
            )
            ws.close()
            attempts.append(
                Attempt("server", "open the victim's kernel websocket", "leak", "connected")
            )
        except (HTTPClientError, WebSocketClosedError) as e:
            code = getattr(e, "code", 403)
            attempts.append(
                Attempt(
                    "server", "open the victim's kernel websocket", _http_outcome(code), str(code)
                )
            )
    return attempts


async def server_token_attacks(hub: Hub) -> list[Attempt]:
    """From the attacker's kernel, with her server's own token (JUPYTERHUB_API_TOKEN)."""
    code = f"""
import json, os, urllib.request, urllib.error
api = os.environ["JUPYTERHUB_API_URL"]
token = os.environ["JUPYTERHUB_API_TOKEN"]
out = {{}}
for name, method, path in [
    ("read the victim with the server's token", "GET", "/users/{VICTIM}"),
    ("stop the victim's server with the server's token", "DELETE", "/users/{VICTIM}/server"),
    ("list users with the server's token", "GET", "/users"),
]:
    req = urllib.request.Request(api + path, method=method, headers={{"Authorization": "token " + token}})
    try:
        out[name] = urllib.request.urlopen(req, timeout=20).status
    except urllib.error.HTTPError as e:
        out[name] = e.code
print(json.dumps(out))
"""
    out = await run_in_kernel(hub, ATTACKER, code)
    results = json.loads(out.splitlines()[-1])
    return [
        Attempt("tokens", name, _http_outcome(status), str(status))
        for name, status in results.items()
    ]


async def input_attacks(hub: Hub, victim: dict[str, Any]) -> list[Attempt]:
    """Oversized and malformed input to gpulab's endpoints: 4xx, never 5xx, nothing created."""
    token = victim["tokens"][ATTACKER]
    api = f"{hub.url}/hub/api"
    big = {"profile": "x" * (10 * 1024 * 1024)}
    cases: list[tuple[str, str, str, Any]] = [
        ("a 10 MB spawn body", "POST", f"{api}/users/{ATTACKER}/servers/big", big),
        ("a 10 MB clone body", "POST", f"{api}/gpulab/users/{ATTACKER}/snapshots/x/clone", big),
        ("a named server called 'default'", "POST", f"{api}/users/{ATTACKER}/servers/default", {}),
        (
            "a server option that is not an object",
            "POST",
            f"{api}/users/{ATTACKER}/servers/odd",
            ["gpu"],
        ),
        (
            "an unknown profile",
            "POST",
            f"{api}/users/{ATTACKER}/servers/odd",
            {"profile": "../../etc"},
        ),
        (
            "a snapshot id with a path in it",
            "POST",
            f"{api}/gpulab/users/{ATTACKER}/snapshots/..%2F..%2Fetc/restore",
            None,
        ),
    ]
    attempts = []
    async with httpx.AsyncClient(headers={"Authorization": f"token {token}"}, timeout=60) as client:
        for name, method, url, body in cases:
            r = await client.request(method, url, json=body)
            attempts.append(
                Attempt("input", name, _http_outcome(r.status_code), str(r.status_code))
            )
    model = hub.api("GET", f"/users/{ATTACKER}").json()
    leftover = sorted(set(model.get("servers", {})) - {""})
    attempts.append(
        Attempt(
            "input",
            "refused spawns leave no server record",
            "leak" if leftover else "refused",
            ",".join(leftover),
        )
    )
    return attempts


async def local_attack_suite(hub: Hub) -> list[Attempt]:
    """Every attempt of the catalogue against a running local hub (per-user accounts)."""
    victim = await prepare_victim(hub)
    attempts = []
    attempts += await kernel_attacks(hub)
    attempts += await server_token_attacks(hub)
    attempts += await api_attacks(hub, victim)
    attempts += await input_attacks(hub, victim)
    attempts += await fifo_deputy_attacks(hub, victim)
    attempts += await deputy_attacks(hub)
    return attempts


# -- Kubernetes (GPUKubeSpawner on the dev cluster) ------------------------------------------------

#: where Kubernetes would mount a pod's service-account token (automount)
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
#: the cloud metadata address; the kube suite serves it on this machine (metadata_endpoint), so
#: that a pod's connection would succeed were the NetworkPolicy's `except` missing
CLOUD_METADATA = ("169.254.169.254", 80)

# Runs in the attacker's kernel in her pod: the visible processes (any of the victim's, any of the
# node's: the hub, the control plane) and a TCP connection to each target.
KUBE_PROBE = (
    PROBE_READS
    + """
victims, foreign = [], []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        environ = b""
    if VICTIM_MARKER.encode() in environ or VICTIM_MARKER.encode() in cmdline:
        victims.append(pid)
    if any(m.encode() in cmdline for m in NODE_MARKERS):
        foreign.append(pid)
results["see the victim's processes"] = f"allowed {victims}" if victims else "denied"
results["see the node's processes"] = f"allowed {foreign}" if foreign else "denied"
def signal_victim():
    # a pid is a number in the reader's own PID namespace: only a victim's process counts
    environ = open(f"/proc/{VICTIM_PID}/environ", "rb").read()
    if VICTIM_MARKER.encode() not in environ:
        raise PermissionError("not the victim's")
    os.kill(VICTIM_PID, 0)
results["signal the victim's server by its node pid"] = attempt(signal_victim)
for name, (host, port) in CONNECT.items():
    def connect():
        socket.create_connection((host, port), timeout=5).close()
    outcome = attempt(connect)
    results[name] = "denied" if outcome in ("ConnectionRefusedError", "ConnectionResetError",
                                            "TimeoutError") else outcome
for name, path in CONTROL_READS.items():
    results[name] = attempt(lambda: open(path, "rb").read(1))
for name, (host, port) in CONTROL_CONNECT.items():
    results[name] = attempt(lambda: socket.create_connection((host, port), timeout=5).close())
print(json.dumps(results))
"""
)


def _pod_of(cluster: DevCluster, user: str) -> dict[str, Any]:
    pods = cluster.api("GET", "/api/v1/namespaces/default/pods")["items"]
    (pod,) = [
        p
        for p in pods
        if (p["metadata"].get("annotations") or {}).get("hub.jupyter.org/username") == user
        and not p["metadata"].get("deletionTimestamp")
    ]
    return pod


def _volume_of(cluster: DevCluster, pod: dict[str, Any]) -> Path:
    """The node's folder of the pod's home claim (a gpulab-local PV is a hostPath)."""
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "gpulab-home"]
    claim = vol["persistentVolumeClaim"]["claimName"]
    pvc = cluster.api("GET", f"/api/v1/namespaces/default/persistentvolumeclaims/{claim}")
    pv = cluster.api("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    return Path(pv["spec"]["hostPath"]["path"])


def _pod_dir(cluster: DevCluster, pod: dict[str, Any]) -> Path:
    meta = pod["metadata"]
    return cluster.state_dir / "agent" / "pods" / f"default_{meta['name']}_{meta['uid'][:8]}"


def _host_pids_of(user: str) -> list[int]:
    """This machine's pids of the user's server processes (their environments name the user)."""
    marker = f"\0JUPYTERHUB_USER={user}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in b"\0" + (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return sorted(pids)


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (the hub: its proxy and its managed services)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _listening_ports(pids: set[int]) -> set[int]:
    """TCP ports on which the processes `pids` listen."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    ports = set()
    for table_path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table_path).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def metadata_endpoint() -> Iterator[None]:
    """Serve TCP at the cloud metadata address on this machine (an address on `lo`, removed
    afterwards when this added it), as a cloud would: a probe that finds nothing there proves
    nothing. Needs root."""
    host, port = CLOUD_METADATA
    added = False
    if (
        f"{host}/32"
        not in subprocess.run(
            ["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True
        ).stdout
    ):
        subprocess.run(["ip", "addr", "add", f"{host}/32", "dev", "lo"], check=True)
        added = True
    server = socket.create_server((host, port))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.5)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        server.close()
        if added:
            subprocess.run(["ip", "addr", "del", f"{host}/32", "dev", "lo"], check=False)


def _ports_servers_call(pod: dict[str, Any]) -> set[int]:
    """The hub-side ports a server is told to call (the hub API, the metrics push), from its pod's
    environment: what the servers' NetworkPolicy lets it reach on the hub."""
    env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
    urls = [env["JUPYTERHUB_API_URL"], env[PUSH_URL_ENV]]
    return {int(urlsplit(url).port or 80) for url in urls}


async def kube_kernel_attacks(hub: Hub, cluster: DevCluster) -> list[Attempt]:
    """From inside the attacker's kernel in her pod: the victim's volume, key, checkpoint, snapshot
    and log where the node keeps them, the hub's and the cluster's secrets, the service-account
    token, the victim's processes, and connections to everything a pod must not reach. Every
    target is first shown to exist (and every address to answer) from outside the pod."""
    victim_pod = _pod_of(cluster, VICTIM)
    volume, pod_dir = _volume_of(cluster, victim_pod), _pod_dir(cluster, victim_pod)
    state, agent = hub.state_dir, cluster.state_dir / "agent"
    victim_snapshots = [p for p in (agent / "snapshots").rglob("diary.txt")]
    reads = {
        "victim's file on the node": str(volume / "diary.txt"),
        "victim's checkpoint on the node": str(
            next((volume / ".gpulab" / "checkpoints").rglob("manifest.json"), "no checkpoint")
        ),
        "victim's key file on the node": str(pod_dir / "volumes" / "gpulab-checkpoint-key" / "key"),
        "victim's snapshot on the node": str(victim_snapshots[0] if victim_snapshots else "none"),
        "victim's container log": str(next(pod_dir.glob("*.log"), "no log")),
        "hub database": str(state / "jupyterhub.sqlite"),
        "hub cookie secret": str(state / "jupyterhub_cookie_secret"),
        "hub checkpoint secret": str(state / "gpulab-checkpoint-secret"),
        # (no allocations database: on Kubernetes placements live in pod annotations)
        "initial admin password": str(state / "initial-admin-password"),
        "cluster kubeconfig (cluster-admin token)": str(cluster.kubeconfig),
        "cluster state (cluster-admin token)": str(cluster.state_dir / "cluster.json"),
        "API server token file": str(cluster.state_dir / "secrets" / "tokens.csv"),
        "service-account signing key": str(cluster.state_dir / "secrets" / "sa.key"),
        "agent control address": str(agent / "control.json"),
    }
    missing = [name for name, path in reads.items() if not Path(path).is_file()]
    assert not missing, f"the probe's targets must exist to prove anything: {missing}"
    # the attacker's pod reads the key at the mount path: her own, never the victim's (they differ)
    listings = {
        "list the victim's volume on the node": str(volume),
        "list all pods' folders": str(agent / "pods"),
        "list all volumes": str(agent / "volumes"),
        "list the cluster's etcd data": str(cluster.state_dir / "etcd"),
        "list the hub's state": str(state),
    }
    # the token Kubernetes would mount: the namespace's default ServiceAccount has one, so only
    # automountServiceAccountToken: false keeps it out of the pod
    default_sa = cluster.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
    assert default_sa.get("secrets"), "the default ServiceAccount has no token to mount"
    reads["service-account token"] = SERVICE_ACCOUNT_TOKEN

    victim_ip = victim_pod["status"]["podIP"]
    cluster_state = json.loads((cluster.state_dir / "cluster.json").read_text())
    control = json.loads((agent / "control.json").read_text())
    connect: dict[str, tuple[str, int]] = {
        "victim's server": (victim_ip, 8888),
        "cloud metadata 169.254.169.254:80": CLOUD_METADATA,
        "Kubernetes API server": ("127.0.0.1", cluster_state["ports"]["apiserver"]),
        "etcd (every Secret, unauthenticated)": ("127.0.0.1", cluster_state["ports"]["etcd"]),
        "node agent control API": ("127.0.0.1", control["port"]),
    }
    assert hub.proc is not None
    # the API and the metrics push are what servers must reach; the public address answers
    # everyone (and asks who they are), so reaching it is no leak
    allowed = _ports_servers_call(victim_pod) | {hub.port}
    for port in sorted(_listening_ports(_descendants(hub.proc.pid)) - allowed):
        connect[f"hub-side port {port} (not the API)"] = ("127.0.0.1", port)
    assert hub.proxy_api_port in {p for _, p in connect.values()}, "the proxy's API is a target"
    closed = [name for name, (host, port) in connect.items() if not _reachable(host, port)]
    assert not closed, f"the probe's addresses must answer from outside to prove anything: {closed}"

    victim_pids = _host_pids_of(VICTIM)
    assert victim_pids, "the victim's server must run on this machine"
    # controls, not attempts: the same probe reads the attacker's own key and reaches the hub API,
    # so a refusal is the isolation's and not that of a probe that can do nothing at all
    control_reads = {"control: own key": CHECKPOINT_KEY_FILE}
    control_connect = {"control: the hub API": ("127.0.0.1", hub.hub_port)}
    code = (
        f"READS = {reads!r}\nLISTINGS = {listings!r}\nCONNECT = {connect!r}\n"
        f"VICTIM_MARKER = {'JUPYTERHUB_USER=' + VICTIM!r}\nVICTIM_PID = {victim_pids[0]!r}\n"
        f"NODE_MARKERS = {['jupyterhub_config', 'kube-apiserver', 'etcd']!r}\n"
        f"CONTROL_READS = {control_reads!r}\nCONTROL_CONNECT = {control_connect!r}\n" + KUBE_PROBE
    )
    out = await run_in_kernel(hub, ATTACKER, code)
    results = json.loads(out.splitlines()[-1])
    controls = {name: results.pop(name) for name in [*control_reads, *control_connect]}
    assert set(controls.values()) == {"allowed"}, f"the probe cannot work: {controls}"

    def category(name: str) -> str:
        if name in connect:
            return "kube:network"
        if name.startswith(("victim's", "list the victim's", "list all")):
            return "kube:files"
        if name.startswith(("see", "signal")):
            return "kube:processes"
        if name.startswith(("hub", "allocations", "initial", "list the hub")):
            return "kube:hub secrets"
        return "kube:cluster secrets"

    return [
        Attempt(
            category(name),
            name,
            "refused" if result in ("denied", "missing") else "leak",
            result,
        )
        for name, result in results.items()
    ]


# Runs in the attacker's kernel: a FIFO where the hub looks for her kernel checkpoint's manifest
# (a reader of it waits for a writer, forever), or, with UNBLOCK, the FIFO opened for writing and
# removed (a reader still waiting gets end-of-file).
PLANT_FIFO = """
import errno, os, shutil
slot = os.path.join(os.environ["GPULAB_CHECKPOINT_DIR"], "fifo-probe")
if UNBLOCK:
    try:
        os.close(os.open(os.path.join(slot, "manifest.json"), os.O_WRONLY | os.O_NONBLOCK))
        print("a reader was waiting")
    except OSError as e:
        print("no reader" if e.errno == errno.ENXIO else e)
    shutil.rmtree(slot)
else:
    os.makedirs(slot)
    os.mkfifo(os.path.join(slot, "manifest.json"))
    print("planted")
"""


async def fifo_deputy_attacks(hub: Hub, victim: dict[str, Any]) -> list[Attempt]:
    """The hub reads the kernel checkpoints in a user's home for the picker's offer (on the dev
    cluster the volume is a folder on the hub's machine; locally a worker reads them as the user):
    the attacker plants a FIFO there. A reader that opened it would wait for a writer for ever: a
    thread of the hub's pool, or a worker per request, lost."""
    out = await run_in_kernel(hub, ATTACKER, "UNBLOCK = False\n" + PLANT_FIFO)
    assert "planted" in out, out
    url = f"{hub.url}/hub/api/gpulab/users/{ATTACKER}/snapshots"
    headers = {"Authorization": f"token {victim['tokens'][ATTACKER]}"}
    try:
        # the listing answers in well under a second; a minute without an answer is a hub stuck
        async with httpx.AsyncClient(headers=headers, timeout=60) as client:
            r = await client.get(url)
        attempt = Attempt(
            "confused deputy",
            "the hub opens a FIFO in her checkpoints",
            _http_outcome(r.status_code) if r.status_code != 200 else "refused",
            str(r.status_code),
        )
    except httpx.TimeoutException:
        attempt = Attempt(
            "confused deputy",
            "the hub opens a FIFO in her checkpoints",
            "leak",
            "no answer: the hub waits on the FIFO",
        )
    await run_in_kernel(hub, ATTACKER, "UNBLOCK = True\n" + PLANT_FIFO)  # frees a stuck reader
    return [attempt]


async def kube_attack_suite(hub: Hub, cluster: DevCluster, profile: str = "cpu") -> list[Attempt]:
    """Every attempt of the catalogue against a hub with GPUKubeSpawner on the dev cluster, inside
    `metadata_endpoint()`; the categories are prefixed "kube:"."""
    victim = await prepare_victim(hub, profile=profile)
    attempts = await kube_kernel_attacks(hub, cluster)
    shared = await server_token_attacks(hub)
    shared += await api_attacks(hub, victim)
    shared += await input_attacks(hub, victim)
    shared += await fifo_deputy_attacks(hub, victim)
    # the node's snapshotter (root) copies the attacker's volume: it must keep a link a link
    shared += await deputy_attacks(
        hub,
        target=cluster.kubeconfig,
        snapshot_root=cluster.state_dir / "agent",  # snapshot trees and the restored volume
        profile=profile,
    )
    return attempts + [Attempt(f"kube:{a.category}", a.name, a.outcome, a.detail) for a in shared]


def table(attempts: list[Attempt]) -> str:
    """Attempts by category: count, leaks, server errors; then every attempt that was not refused."""
    cats: dict[str, list[Attempt]] = {}
    for a in attempts:
        cats.setdefault(a.category, []).append(a)
    lines = [f"{'category':<24} {'attempts':>8} {'leaks':>6} {'5xx':>4}"]
    for cat, items in cats.items():
        leaks = sum(a.outcome == "leak" for a in items)
        errors = sum(a.outcome == "server_error" for a in items)
        lines.append(f"{cat:<24} {len(items):>8} {leaks:>6} {errors:>4}")
    for a in attempts:
        if a.outcome != "refused":
            lines.append(f"  {a.outcome.upper()}: [{a.category}] {a.name} ({a.detail})")
    return "\n".join(lines)
