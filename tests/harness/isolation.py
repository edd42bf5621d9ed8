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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClosedError, websocket_connect

from tests.harness.hub import Hub, run_in_kernel
from tests.harness.isolation_dask import (
    dask_pids,
    is_loopback,
    listening_sockets,
    machine_addresses,
    outcome,
    probe_code,
    run_probe_here,
    start_victim_cluster,
    stop_victim_cluster,
)

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
    # an explicit save: the checkpoint exists when the cell returns, however loaded the machine
    # (the idle-time save and the one at kernel shutdown race a busy CI runner)
    await run_in_kernel(
        hub,
        VICTIM,
        "open('diary.txt', 'w').write('private')\nsecret = 42\n"
        "get_ipython().run_line_magic('gpulab_save', '')",
    )
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
        "victim's snapshot": str(
            next(
                p for p in (state / "snapshots" / VICTIM / "default").iterdir() if p.name[0] != "."
            )
        ),
        "hub database": str(state / "jupyterhub.sqlite"),
        "hub cookie secret": str(state / "jupyterhub_cookie_secret"),
        "hub checkpoint secret": str(state / "gpulab-checkpoint-secret"),
        "allocations database": str(state / "gpulab-allocations.sqlite"),
        "initial admin password": str(state / "initial-admin-password"),
        # `gpulab stop`'s token (the shutdown scope): the hub's account's alone (0600)
        "hub stop token": str(state / "gpulab-stop.json"),
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
    ("shut the hub down with the server's token", "POST", "/shutdown"),
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
    attempts += await dask_attacks(hub)
    return attempts


async def dask_attacks(hub: Hub) -> list[Attempt]:
    """The victim's Dask cluster (scheduler and one worker, processes of her account) against
    the attacker's kernel on every address of this machine, and against a client of this
    process (no tenant) on every address but loopback: tests/harness/isolation_dask.py."""
    cluster = start_victim_cluster(hub, VICTIM)
    try:
        sockets = listening_sockets(dask_pids(hub.account(VICTIM).pw_uid))
        ports = sorted({port for _address, port in sockets})
        # the scheduler's comm and dashboard, the worker's nanny, comm and HTTP server
        assert len(ports) >= 5, (
            f"the victim's Dask processes must listen to prove anything: {sockets}"
        )
        addresses = machine_addresses()
        targets = [
            (f"{address} port {port}", address, port, is_loopback(address))
            for address in addresses
            for port in ports
        ]
        out = await run_in_kernel(hub, ATTACKER, probe_code(targets), timeout=300)
        from_kernel = json.loads(out.splitlines()[-1])
        off_loopback = [t for t in targets if not t[3]]
        from_outside = run_probe_here(off_loopback)
    finally:
        stop_victim_cluster(hub, VICTIM, cluster)
    return [
        Attempt("dask", f"her kernel, {name}", outcome(result), result)
        for name, result in from_kernel.items()
    ] + [
        Attempt("dask", f"off loopback, {name}", outcome(result), result)
        for name, result in from_outside.items()
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
