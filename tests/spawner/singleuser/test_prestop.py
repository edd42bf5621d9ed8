"""The pod preStop hook signals this server's kernels, and only them."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from gpulab.spawner.singleuser.prestop import kernel_pids, main

FAKE_KERNEL = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
    "print('ready', flush=True); time.sleep(60)"
)


def _kernel(prefix: str) -> subprocess.Popen:
    # argv names ipykernel as a real kernel's does; the body just waits for SIGTERM
    env = dict(os.environ, JUPYTERHUB_SERVICE_PREFIX=prefix)
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_KERNEL, "-m", "ipykernel_launcher"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    return proc


def test_prestop_terminates_only_this_servers_kernels_and_waits_for_them(tmp_path: Path):
    # a process table of this test's own processes (links to their /proc entries), and prefixes
    # no other server on the machine has: whatever else runs here cannot be found or signalled
    tag = uuid.uuid4().hex[:8]
    mine, other = f"/user/prestop-{tag}/", f"/user/prestop-other-{tag}/"
    ours, theirs = _kernel(mine), _kernel(other)
    proc = tmp_path / "proc"
    proc.mkdir()
    for p in (ours, theirs):
        (proc / str(p.pid)).symlink_to(f"/proc/{p.pid}")
    try:
        assert kernel_pids(mine, proc) == [ours.pid]
        assert main(["--prefix", mine, "--timeout", "10", "--proc", str(proc)]) == 0
        assert ours.wait(5) == 7  # its SIGTERM handler ran (the checkpoint extension's hook point)
        assert theirs.poll() is None
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
