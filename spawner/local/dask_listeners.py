"""Where a local Dask cluster's processes listen, and how the hub checks what they say of it.

Every listener of a cluster is on 127.0.0.1, and nowhere else:

- the scheduler's comm (``--host 127.0.0.1``, TLS, a port it picks) and its HTTP server, the
  dashboard (``--dashboard-address 127.0.0.1:0``);
- each worker's nanny and worker comms (``--host 127.0.0.1``, TLS), and the worker's HTTP
  server (``--dashboard-address 127.0.0.1:0``: distributed starts it on ``--dashboard-address``,
  whose default ``:0`` means every interface, even with ``--no-dashboard``).

Why another tenant cannot use them. From another machine (or a pod, a container with a network
of its own) nothing answers: 127.0.0.1 is this machine's own. Every local account reaches
127.0.0.1, so each listener guards itself too: the comms require mutual TLS with the cluster's
own certificate (``distributed.comm.require-encryption``; a peer without it fails the
handshake), the dashboard answers only under a secret prefix only the hub's proxy is told (so
the owner reaches it through the hub alone), and the workers' HTTP servers serve no route at all
(``gpulab.spawner.local.dask_files.dask_config``). The owner reaches her cluster with the
credentials the hub's REST API gives her.

The scheduler's file is the owner's (she could name another port in it): the hub takes its
address only once the kernel's sockets show her account listening there and a handshake with
the cluster's credentials succeeds.
"""

from __future__ import annotations

import json
import math
import re
import socket
import ssl
from pathlib import Path

from gpulab.hub.allocator import Placement
from gpulab.hub.dask import worker_name
from gpulab.spawner.local.dask_files import ClusterFiles, DaskExecutorError
from gpulab.spawner.local.processes import read_small

SCHEDULER_MODULE = "gpulab.spawner.singleuser.dask_scheduler"
WORKER_MODULE = "gpulab.spawner.singleuser.dask_worker"
#: the only address a local cluster's processes listen on (see the module docstring)
LOOPBACK = "127.0.0.1"
#: the address a local scheduler answers on
LOCAL_SCHEDULER_ADDRESS = re.compile(r"tls://127\.0\.0\.1:(?P<port>[0-9]{1,5})")
#: a scheduler file is a small JSON object; anything longer is not the scheduler's
MAX_SCHEDULER_FILE_BYTES = 1 << 16


def scheduler_args(scheduler_file: Path) -> list[str]:
    """The scheduler's arguments (after ``python -m SCHEDULER_MODULE``): its file, TLS on
    loopback at a port it picks, its dashboard on loopback too."""
    return [
        "--scheduler-file",
        str(scheduler_file),
        "--host",
        LOOPBACK,
        "--port",
        "0",
        "--protocol",
        "tls",
        "--dashboard-address",
        f"{LOOPBACK}:0",
    ]


def uses_dask_cuda_here(placement: Placement) -> bool:
    """Whether the worker gets ``--gpu`` (its placement holds a GPU share); the launcher then
    runs dask-cuda's worker where dask_cuda is importable."""
    return bool(placement.gpus)


def worker_args(
    placement: Placement, scheduler_address: str, number: int, python: str
) -> list[str]:
    """The worker's command: the launcher (which picks dask-cuda's worker or a plain one), the
    scheduler, its name, loopback only (its comms and its HTTP server), no dashboard of its own, threads and memory from the
    profile (``--nthreads`` from the CPU share, at least one; ``--memory-limit`` from the memory,
    Dask's own default where the profile sets none)."""
    if not LOCAL_SCHEDULER_ADDRESS.fullmatch(scheduler_address):
        raise DaskExecutorError(
            f"a local scheduler's address is tls://127.0.0.1:<port>, got {scheduler_address!r:.80}"
        )
    argv = [python, "-m", WORKER_MODULE]
    if uses_dask_cuda_here(placement):
        argv.append("--gpu")
    argv += [
        "--",
        scheduler_address,
        "--name",
        worker_name(number),
        "--host",
        LOOPBACK,
        # its HTTP server: distributed's default (":0") is every interface, --no-dashboard or not
        "--dashboard-address",
        f"{LOOPBACK}:0",
        "--no-dashboard",
        "--nthreads",
        str(max(1, math.ceil(placement.request.cpu_milli / 1000))),
    ]
    if placement.request.memory_mib:
        argv += ["--memory-limit", f"{placement.request.memory_mib}MiB"]
    return argv


def loopback_listener_uid(port: int) -> int | None:
    """The uid of the socket listening on 127.0.0.1:``port`` (/proc/net/tcp), or None."""
    want = f"0100007F:{port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 7 and parts[1] == want and parts[3] == "0A":  # 0A: LISTEN
            return int(parts[7])
    return None


def read_scheduler_file(path: Path, uid: int) -> tuple[str, int] | None:
    """(address, dashboard port) from the scheduler's file once it is complete and both ports
    are listened on by the owner's account; None until then. The file is the owner's: what it
    says is checked against the kernel's sockets, never taken on trust."""
    raw = read_small(str(path), MAX_SCHEDULER_FILE_BYTES)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        address = data["address"]
        dashboard_port = data["services"]["dashboard"]
    except (ValueError, KeyError, TypeError):
        return None  # still being written
    match = LOCAL_SCHEDULER_ADDRESS.fullmatch(address) if isinstance(address, str) else None
    if match is None or not isinstance(dashboard_port, int) or not 0 < dashboard_port < 65536:
        # its words are not repeated: the file is the owner's, the message the hub's log
        raise DaskExecutorError(
            "the scheduler's file does not name a tls://127.0.0.1 address and a dashboard port"
        )
    for port in (int(match["port"]), dashboard_port):
        if loopback_listener_uid(port) != uid:
            return None
    return address, dashboard_port


def accepts_cluster_tls(address: str, files: ClusterFiles) -> bool:
    """Whether the scheduler completes a mutual TLS handshake with the cluster's
    credentials (as Dask's ``Security`` sets it up: no host name check)."""
    match = LOCAL_SCHEDULER_ADDRESS.fullmatch(address)
    assert match is not None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.cert))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(files.cert), str(files.key))
    try:
        with (
            socket.create_connection(("127.0.0.1", int(match["port"])), timeout=5) as sock,
            ctx.wrap_socket(sock) as tls_sock,
        ):
            tls_sock.do_handshake()
            return True
    except (OSError, ssl.SSLError):
        return False
