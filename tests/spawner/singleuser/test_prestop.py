"""The pod preStop hook signals this server's kernels, and only them."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_prestop_terminates_only_this_servers_kernels_and_waits_for_them():
    ours, theirs = _kernel("/user/alice/"), _kernel("/user/bob/")
    try:
        assert kernel_pids("/user/alice/") == [ours.pid]
        assert main(["--prefix", "/user/alice/", "--timeout", "10"]) == 0
        assert ours.wait(5) == 7  # its SIGTERM handler ran (the checkpoint extension's hook point)
        assert theirs.poll() is None
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait()
