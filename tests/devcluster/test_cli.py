"""`gpulab dev-cluster up|status|down` from a shell, in its own state dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpulab.devcluster.procs import stray_processes


def gpulab(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gpulab.hub.cli", "dev-cluster", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# a gpulab without the gpulab-devcluster distribution (None in sys.modules: the import fails as if
# the package were absent, while this venv keeps it installed for the other tests)
WITHOUT_DEVCLUSTER = """
import sys
sys.modules["gpulab.devcluster"] = None
from gpulab.hub.cli import main
sys.exit(main(["dev-cluster", *sys.argv[1:]]))
"""


def test_cli_without_the_devcluster_distribution_says_how_to_install_it() -> None:
    for action in ("up", "status", "down"):
        done = subprocess.run(
            [sys.executable, "-c", WITHOUT_DEVCLUSTER, action],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert "not installed" in done.stderr and "pip install -e ./devcluster" in done.stderr


def test_cli_up_status_down_leaves_no_process_behind(tmp_path: Path, dev_cluster) -> None:
    state = tmp_path / "cli-cluster"
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([{"name": "cli-gpu-0", "gpus": 2}]))
    try:
        up = gpulab("--state-dir", str(state), "up", "--nodes", str(nodes))
        assert up.returncode == 0, up.stderr
        assert str(state / "kubeconfig") in up.stdout
        again = gpulab("--state-dir", str(state), "up", "--nodes", str(nodes))
        assert again.returncode == 0 and "already running" in again.stderr
        status = gpulab("--state-dir", str(state), "status", "--json")
        assert status.returncode == 0, status.stderr
        info = json.loads(status.stdout)
        assert info["up"] and info["kubeconfig"] == str(state / "kubeconfig")
        assert set(info["processes"]) == {
            "etcd",
            "kube-apiserver",
            "kube-scheduler",
            "kube-controller-manager",
            "kube-proxy",
            "agent",
        }
        assert info["nodes"]["cli-gpu-0"]["running"] is True
    finally:
        down = gpulab("--state-dir", str(state), "down")
    assert down.returncode == 0, down.stderr
    assert stray_processes(str(state), ("",)) == []
    after = gpulab("--state-dir", str(state), "status")
    assert after.returncode == 3 and "down" in after.stdout
