"""The in-pod workspace preparation of GPUKubeSpawner's servers, and the checkpoint secret."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpulab.spawner.singleuser.checkpoint.environment import STARTUP_FILE, user_site
from gpulab.spawner.singleuser.checkpoint.prepare import container_env
from gpulab.spawner.singleuser.checkpoint.secret import load_or_create_secret
from gpulab.spawner.singleuser.lab_start import CONFIG_DIR

SHOW_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


def test_prepare_readies_the_home_then_runs_the_server_command_with_its_environment(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": "/somewhere/else",
        "GPULAB_CHECKPOINT_DIR": str(home / ".gpulab" / "checkpoints" / "exp"),
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulab.spawner.singleuser.checkpoint.prepare",
            "--home",
            str(home),
            "--",
        ]
        + [sys.executable, "-c", SHOW_ENV],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(out.stdout)
    assert (home / ".ipython" / "profile_default" / "startup" / STARTUP_FILE).is_file()
    assert stat.S_IMODE((home / ".gpulab").stat().st_mode) == 0o700
    assert seen["HOME"] == str(home)
    assert seen["PATH"].split(os.pathsep)[0] == str(home / ".local" / "bin")
    # this test runs in a virtualenv: packages go to the home through PIP_PREFIX + PYTHONPATH
    assert seen["PIP_PREFIX"] == str(home / ".local") and "PIP_USER" not in seen
    assert str(user_site(home)) in seen["PYTHONPATH"].split(os.pathsep)
    # what the spawner set is kept, the rest filled in
    assert seen["GPULAB_CHECKPOINT_DIR"] == env["GPULAB_CHECKPOINT_DIR"]
    assert seen["IPYTHONDIR"] == str(home / ".ipython")
    # gpulab's Jupyter configuration first (lab_start: JupyterLab starts without running yarn)
    assert seen["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0] == str(CONFIG_DIR)


def test_outside_a_virtualenv_pip_installs_into_the_user_base(tmp_path: Path) -> None:
    env = container_env(tmp_path, {"PATH": "/usr/bin", "PIP_PREFIX": "/stale"})
    assert env["PATH"] == f"{tmp_path / '.local' / 'bin'}{os.pathsep}/usr/bin"
    if sys.prefix == sys.base_prefix:
        assert env["PIP_USER"] == "1" and "PIP_PREFIX" not in env


def test_prepare_without_a_command_only_prepares(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulab.spawner.singleuser.checkpoint.prepare",
            "--home",
            str(tmp_path / "h"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "prepared workspace" in r.stderr
    assert (tmp_path / "h" / ".local" / "bin").is_dir()


def test_a_missing_command_is_reported(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulab.spawner.singleuser.checkpoint.prepare",
            "--home",
            str(tmp_path),
        ]
        + ["--", "gpulab-no-such-server"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 127 and "gpulab-no-such-server" in r.stderr


def test_the_checkpoint_secret_is_created_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "secret"
    first = load_or_create_secret(path)
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_secret(path) == first
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16"):
        load_or_create_secret(path)
