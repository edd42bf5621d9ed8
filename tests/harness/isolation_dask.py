"""The Dask part of the cross-user attack catalogue (tests/harness/isolation.py): the attacker
against the victim's Dask cluster, its scheduler's and workers' every listening port, on every
address it could be reached at.

Each port of the victim's Dask processes (scheduler comm and dashboard, each worker's nanny and
worker comms and its HTTP server) gets, at each address: a TCP connection, HTTP GETs of
/metrics, /health, /info and the dashboard without its secret prefix, a TLS handshake without
the cluster's certificate, and a plain (tcp://) Dask comm handshake. An attempt is a leak when
an HTTP answer is 2xx, a handshake is answered, or a port takes a connection at an address that
is not loopback (a listener binds to loopback or the pod's address: spawner/local/dask_listeners.py).

Locally the attacker's kernel tries it on every address of this machine, and a client of the
hub's own process on every non-loopback address (as another machine would reach it); on
Kubernetes the attacker's pod tries the victim's scheduler and worker pod addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.harness.hub import Hub

#: what a connection to each port tries (the names of the probe's results)
HTTP_PATHS = ("/metrics", "/health", "/info", "/status", "/", "/sitemap.json")
#: the command lines of a cluster's processes: by module (forked ones are titled as cold starts
#: are) or by the title distributed gives a running scheduler or worker ("dask worker [tls://...]"),
#: never "dask" anywhere (a checkout's own path may say it)
DASK_MODULES = (
    "singleuser.dask_scheduler",
    "singleuser.dask_worker",
    "distributed.",
    " -m dask ",
    "dask scheduler [",
    "dask worker [",
)

# Runs in the attacker's kernel (and in the harness process, for a client off loopback): every
# probe of every target, into `results` {name: outcome}. TARGETS: [[name, host, port, loopback]].
DASK_PROBE = r"""
import asyncio, http.client, json, socket, ssl, urllib.error, urllib.request
def connect(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return "open"
    except (ConnectionRefusedError, ConnectionResetError, TimeoutError, socket.timeout):
        return "denied"
    except OSError as e:
        return type(e).__name__
def http_get(host, port, path):
    # redirects followed: distributed's / redirects to the dashboard under its secret prefix
    url = f"http://{host if ':' not in host else '[' + host + ']'}:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return str(answer.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
def tls_without_certificate(host, port):
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            with ctx.wrap_socket(sock) as tls:
                tls.do_handshake()
                tls.sendall(b"\0" * 8)
                # TLS 1.3: a server that wants a certificate refuses after the handshake
                return "answered" if tls.recv(1) else "closed"
    except (OSError, ssl.SSLError) as e:
        return type(e).__name__
def plain_comm(host, port):
    # distributed's own client: its tcp:// handshake, then an identity request
    try:
        from distributed.comm import connect as dask_connect
    except ImportError:
        return "no distributed"
    async def exchange():
        comm = await dask_connect(f"tcp://{host}:{port}", timeout=5)
        try:
            await comm.write({"op": "identity", "reply": True})
            await comm.read()
        finally:
            comm.abort()
    async def talk():
        # bounded as a whole: an HTTP server never answers the comm's handshake
        await asyncio.wait_for(exchange(), 10)
    try:
        asyncio.run(talk()) if not _loop_running() else _in_thread(talk)
        return "answered"
    except Exception as e:
        return type(e).__name__
def _loop_running():
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
def _in_thread(talk):
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, talk()).result()
results = {}
for name, host, port, loopback in TARGETS:
    reached = connect(host, port)
    results[f"{name}: connect"] = reached if not loopback or reached != "open" else "guarded"
    if reached != "open":
        continue
    for path in HTTP_PATHS:
        results[f"{name}: GET {path}"] = http_get(host, port, path)
    results[f"{name}: TLS without her certificate"] = tls_without_certificate(host, port)
    results[f"{name}: plain comm handshake"] = plain_comm(host, port)
print(json.dumps(results))
"""


def outcome(result: str) -> str:
    """An attempt's outcome from its probe result: a 2xx answer, an answered handshake or a
    connection taken off loopback is a leak; a 5xx a server error; anything else refused."""
    if result.isdigit():
        status = int(result)
        return "leak" if 200 <= status < 300 else "server_error" if status >= 500 else "refused"
    return "leak" if result in ("answered", "open") else "refused"


def machine_addresses() -> list[str]:
    """Every address of this machine's interfaces (IPv4, and IPv6 but link-local, which needs a
    scope), loopback first."""
    found = {"127.0.0.1"}
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET or (
                address.family == socket.AF_INET6 and "%" not in address.address
            ):
                found.add(address.address)
    return sorted(found, key=lambda a: (a != "127.0.0.1", a))


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def _hex_address(text: str) -> str:
    """An address of /proc/net/tcp{,6} ("0100007F", or 32 hex digits) as text."""
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pids: Iterable[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the processes `pids` listen on, read from the
    kernel's tables of each process's own network namespace (/proc/<pid>/net/tcp, tcp6)."""
    found: set[tuple[str, int]] = set()
    for pid in pids:
        inodes: set[str] = set()
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                        address, port = fields[1].split(":")
                        found.add((_hex_address(address), int(port, 16)))
    return found


def dask_pids(uid: int) -> list[int]:
    """The pids of `uid`'s Dask schedulers and workers (by the modules they run)."""
    pids = []
    for proc in psutil.process_iter(["uids", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if any(m in " ".join(proc.info["cmdline"] or []) for m in DASK_MODULES):
                pids.append(proc.pid)
    return pids


def probe_code(targets: list[tuple[str, str, int, bool]]) -> str:
    return f"TARGETS = {[list(t) for t in targets]!r}\nHTTP_PATHS = {HTTP_PATHS!r}\n" + DASK_PROBE


def _victim_token(hub: Hub, victim: str) -> str:
    """A token of the victim's own (JupyterHub's default scopes: hers), on either backend."""
    r = hub.api("POST", f"/users/{victim}/tokens", json={"note": "her dask cluster"})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def start_victim_cluster(hub: Hub, victim: str, profile: str = "cpu") -> dict[str, Any]:
    """The victim's Dask cluster of one worker, made with a token of hers, once running."""
    token = _victim_token(hub, victim)
    with httpx.Client(
        base_url=f"{hub.url}/hub/api/gpulab",
        headers={"Authorization": f"token {token}"},
        timeout=90,
    ) as client:
        r = client.post(f"/users/{victim}/dask-clusters", json={"profile": profile, "n_workers": 1})
        assert r.status_code == 201, r.text
        path = f"/users/{victim}/dask-clusters/{r.json()['id']}"
        deadline = time.monotonic() + 180
        while True:
            model = client.get(path).json()
            if model.get("workers_running") == 1:
                return {**model, "token": token}
            assert model.get("state") not in ("stopped", "failed"), model
            assert time.monotonic() < deadline, f"the victim's cluster did not run: {model}"
            time.sleep(0.5)


def stop_victim_cluster(hub: Hub, victim: str, cluster: dict[str, Any]) -> None:
    r = httpx.delete(
        f"{hub.url}/hub/api/gpulab/users/{victim}/dask-clusters/{cluster['id']}",
        headers={"Authorization": f"token {cluster['token']}"},
        timeout=90,
    )
    assert r.status_code == 200, r.text


def run_probe_here(targets: list[tuple[str, str, int, bool]]) -> dict[str, str]:
    """The probe in this process (a client that is no tenant of the machine)."""
    out: dict[str, str] = {}
    namespace: dict[str, Any] = {"print": lambda text: out.update(json.loads(text))}
    exec(probe_code(targets), namespace)  # the same code the attacker's kernel runs
    return out
