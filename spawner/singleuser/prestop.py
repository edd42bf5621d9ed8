"""preStop hook of gpulab's server pods: let this server's kernels write their final checkpoint.

Kubernetes runs it before it sends SIGTERM to the pod's main process. It sends SIGTERM to the
kernels of this single-user server only (matched by JUPYTERHUB_SERVICE_PREFIX in their
environment), which makes gpulab's kernel extension save and exit, and waits for them, bounded by
--timeout (keep it below the pod's termination grace period).

    python3 -m gpulab.spawner.singleuser.prestop --timeout 50
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path


def kernel_pids(service_prefix: str, proc: Path = Path("/proc")) -> list[int]:
    """Kernel processes (ipykernel) whose environment names this server."""
    marker = f"JUPYTERHUB_SERVICE_PREFIX={service_prefix}".encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if b"ipykernel" not in cmdline:
                continue
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _running(pid: int, proc: Path = Path("/proc")) -> bool:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # an exited child not yet reaped is done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=50.0, help="seconds to wait for the saves")
    parser.add_argument("--prefix", default=os.environ.get("JUPYTERHUB_SERVICE_PREFIX", ""))
    parser.add_argument(
        "--proc", type=Path, default=Path("/proc"), help="the process table to look in (tests)"
    )
    args = parser.parse_args(argv)
    if not args.prefix:
        print("gpulab prestop: no JUPYTERHUB_SERVICE_PREFIX; nothing to do")
        return 0
    pids = kernel_pids(args.prefix, args.proc)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {p for p in alive if _running(p, args.proc)}
    print(f"gpulab prestop: {len(pids) - len(alive)} of {len(pids)} kernels saved and exited")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
