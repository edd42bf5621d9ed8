"""Free loopback ports for the servers tests and benchmarks start.

A port the OS picks (bind to 0) is free at that moment only: the test worker beside this one may be
handed the same port before this worker's server binds it, and then one worker's readiness check
is answered by the other worker's hub (a CI run failed exactly so: the hub "came up", then refused
the test's token). So each pytest-xdist worker takes its ports from a block of its own below the
kernel's ephemeral range (which the OS uses for bind-to-0, outgoing connections and the servers
JupyterHub starts on random ports), and checks each port is free before handing it out, which
covers anything else running on the machine.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

#: below Linux's default ephemeral range (32768-60999), above the usual fixed service ports
_FIRST_PORT = 20000
_BLOCK = 1250
_WORKER_BLOCKS = 8  # gw0 ... gw7; a process outside xdist takes the block after them
#: one past the last port any block hands out; it must stay below the ephemeral range, or an
#: outgoing connection takes a port between the check and the server's bind (the dev-cluster tests
#: run outside xdist, and their block once reached 33499: a CI run's gpulab-metrics failed with
#: "Address already in use" on a port the hub's own connections to pods had been handed)
PORTS_END = _FIRST_PORT + (_WORKER_BLOCKS + 1) * _BLOCK


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) % _WORKER_BLOCKS if worker.startswith("gw") else _WORKER_BLOCKS
    return _FIRST_PORT + index * _BLOCK


#: where in its block this process starts: two test runs at once on one machine (two checkouts)
#: share worker names, so each starts somewhere else in the block; the bind check does the rest
_next_offset = itertools.count(random.randrange(_BLOCK))


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for bind-to-0 and outgoing connections (Linux's default if unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
    except (OSError, ValueError):
        return 32768, 60999
    return int(low), int(high)


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` right now, from this worker's own block (a process
    started moments later binds it; no other test worker is handed it)."""
    start = _block_start()
    for _ in range(_BLOCK):
        port = start + next(_next_offset) % _BLOCK
        if _is_free(host, port):
            return port
    raise RuntimeError(f"no free port in {start}-{start + _BLOCK - 1} on {host}")
