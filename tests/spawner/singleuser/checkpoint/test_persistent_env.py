"""The single-user environment keeps packages, environments and kernels in the home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpulab.spawner.singleuser.checkpoint.environment import (
    STARTUP_FILE,
    persistent_env,
    prepare_home,
    register_env_kernels,
    server_args,
    user_site,
)
from tests.harness.wheels import build_tiny_wheel


def test_outside_a_venv_pip_installs_into_the_user_site_by_default(tmp_path):
    env = persistent_env(tmp_path, in_venv=False, base_env={"PATH": "/usr/bin"})
    assert env["PIP_USER"] == "1" and "PIP_PREFIX" not in env
    assert env["PYTHONUSERBASE"] == str(tmp_path / ".local")
    assert env["PATH"] == f"{tmp_path}/.local/bin:/usr/bin"
    assert env["CONDA_ENVS_DIRS"] == str(tmp_path / ".conda" / "envs")
    assert env["JUPYTER_PATH"].startswith(str(tmp_path / ".local" / "share" / "jupyter"))
    assert env["IPYTHONDIR"] == str(tmp_path / ".ipython")


def test_inside_a_venv_pip_installs_under_the_home_and_it_is_importable(tmp_path):
    env = persistent_env(
        tmp_path, in_venv=True, base_env={"PYTHONPATH": "/caps"}, python_version=(3, 11)
    )
    assert "PIP_USER" not in env and env["PIP_PREFIX"] == str(tmp_path / ".local")
    assert env["PYTHONPATH"] == f"/caps:{tmp_path}/.local/lib/python3.11/site-packages"


def test_checkpoint_settings_per_user_and_server(tmp_path):
    env = persistent_env(
        tmp_path, server="gpu", key_file="/keys/key-alice", user="alice", auto_restore=True
    )
    assert env["GPULAB_CHECKPOINT_DIR"] == str(tmp_path / ".gpulab" / "checkpoints" / "gpu")
    assert env["GPULAB_CHECKPOINT_KEY_FILE"] == "/keys/key-alice"
    assert "GPULAB_CHECKPOINT_KEY" not in env  # the key itself is never in an environment
    assert env["GPULAB_CHECKPOINT_USER"] == "alice" and env["GPULAB_AUTO_RESTORE"] == "1"
    assert "GPULAB_AUTO_RESTORE" not in persistent_env(tmp_path)
    assert server_args(30) == ["--KernelManager.shutdown_wait_time=30.0"]


def test_prepare_home_loads_the_extension_in_every_ipython_and_is_idempotent(tmp_path):
    prepare_home(tmp_path)
    startup = tmp_path / ".ipython" / "profile_default" / "startup" / STARTUP_FILE
    assert "gpulab.spawner.singleuser.checkpoint.kernel" in startup.read_text()
    assert (tmp_path / ".gpulab").stat().st_mode & 0o077 == 0
    prepare_home(tmp_path)
    assert len(list(startup.parent.iterdir())) == 1


def test_environments_under_the_home_get_kernelspecs(tmp_path):
    env_dir = tmp_path / ".conda" / "envs" / "torch"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text("")
    (env_dir / "lib" / "python3.11" / "site-packages" / "ipykernel").mkdir(parents=True)
    (tmp_path / ".conda" / "envs" / "no-kernel" / "bin").mkdir(parents=True)
    assert register_env_kernels(tmp_path) == ["gpulab-env-torch"]
    spec = json.loads(
        (tmp_path / ".local/share/jupyter/kernels/gpulab-env-torch/kernel.json").read_text()
    )
    assert spec["argv"][0] == str(env_dir / "bin" / "python")
    assert spec["display_name"] == "Python (torch)"


def _base_python() -> Path | None:
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if sys.base_prefix == sys.prefix or not base.exists():
        return None
    ok = subprocess.run([base, "-m", "pip", "--version"], capture_output=True).returncode == 0
    return base if ok else None


@pytest.mark.skipif(_base_python() is None, reason="needs a non-venv Python with pip")
def test_pip_install_user_outside_a_venv_lands_in_the_home_and_imports(tmp_path):
    python = _base_python()
    home = tmp_path / "home"
    prepare_home(home)
    wheel = build_tiny_wheel(tmp_path / "wheels")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env = {**base, **persistent_env(home, in_venv=False, base_env=base)}
    r = subprocess.run(
        [python, "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (user_site(home) / "gpulab_tinypkg" / "__init__.py").exists()
    out = subprocess.run(
        [python, "-c", "import gpulab_tinypkg as t; print(t.VALUE, t.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("42 " + str(home))
