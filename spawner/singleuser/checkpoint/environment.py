"""The single-user environment that keeps a workspace in its home: installed packages, conda/venv
environments and their kernels, IPython's profile with the checkpoint extension (pure: stdlib).

`persistent_env(home, ...)` returns environment variables for the server (the spawner merges them
into `get_env()`); `prepare_home(home)` creates the directories and the IPython profile startup
file that loads the extension in every Python kernel; `server_args(grace)` gives the server
enough time to let kernels save on shutdown.

Packages: with a Python that is not a virtualenv, `pip install --user` / `%pip install --user`
go to PYTHONUSERBASE=<home>/.local and PIP_USER=1 makes that the default. Inside a virtualenv
(gpulab's own local backend runs the server from its venv), user site-packages are invisible and
pip refuses `--user`; there PIP_PREFIX=<home>/.local sends a plain `pip install` to the same
directory and PYTHONPATH makes it importable. Either way the packages live in the home, so they
survive a restart and travel with snapshots. (pip inside a venv the user created under the home
needs `--no-user`, resp. `PIP_PREFIX=`, to install into that venv.)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from gpulab.spawner.names import (
    AUTO_RESTORE_ENV,
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_KEY_FILE_ENV,
    CHECKPOINT_USER_ENV,
)

EXTENSION = "gpulab.spawner.singleuser.checkpoint.kernel"
STARTUP_FILE = "00-gpulab-checkpoint.py"
_STARTUP_CODE = f"""\
# Written by gpulab: checkpoints the variables of Jupyter kernels (see {EXTENSION}); terminal
# IPython sessions are left alone. Set GPULAB_CHECKPOINT=0 in the environment to switch it off.
if type(get_ipython()).__name__ == "ZMQInteractiveShell":
    get_ipython().extension_manager.load_extension({EXTENSION!r})
"""


def _in_venv() -> bool:
    return sys.prefix != sys.base_prefix


def _join(first: str, rest: str | None) -> str:
    return first if not rest else f"{first}{os.pathsep}{rest}"


def user_site(home: Path, python_version: tuple[int, int] | None = None) -> Path:
    major, minor = python_version or sys.version_info[:2]
    return Path(home) / ".local" / "lib" / f"python{major}.{minor}" / "site-packages"


def persistent_env(
    home: Path,
    *,
    server: str = "",
    base_env: Mapping[str, str] | None = None,
    in_venv: bool | None = None,
    python_version: tuple[int, int] | None = None,
    key_file: Path | str | None = None,
    user: str | None = None,
    auto_restore: bool = False,
) -> dict[str, str]:
    """Environment variables for a single-user server whose state lives in `home`.

    `base_env` is the environment they are merged into (PATH and PYTHONPATH are extended, not
    replaced); `in_venv` says whether the server's Python is a virtualenv (default: this
    process's); `key_file` names the file holding the key that signs kernel checkpoints (never the key
    itself: see `signing.KEY_FILE_ENV`), `user` whose checkpoints they are; `auto_restore` restores
    kernel variables without asking (after a preemption or node-failure respawn)."""
    home = Path(home)
    base = base_env or {}
    local = home / ".local"
    venv = _in_venv() if in_venv is None else in_venv
    env = {
        "HOME": str(home),
        "PYTHONUSERBASE": str(local),
        "PATH": _join(str(local / "bin"), base.get("PATH", os.defpath)),
        # conda: environments and package cache in the home (CONDA_ENVS_PATH for older condas)
        "CONDA_ENVS_DIRS": str(home / ".conda" / "envs"),
        "CONDA_ENVS_PATH": str(home / ".conda" / "envs"),
        "CONDA_PKGS_DIRS": str(home / ".conda" / "pkgs"),
        # kernelspecs installed with `python -m ipykernel install --user` (and gpulab's per-env ones)
        "JUPYTER_PATH": _join(str(local / "share" / "jupyter"), base.get("JUPYTER_PATH")),
        "JUPYTER_DATA_DIR": str(local / "share" / "jupyter"),
        "IPYTHONDIR": str(home / ".ipython"),
        CHECKPOINT_DIR_ENV: str(home / ".gpulab" / "checkpoints" / (server or "default")),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    if venv:
        env["PIP_PREFIX"] = str(local)
        env["PYTHONPATH"] = _join(
            base.get("PYTHONPATH", ""), str(user_site(home, python_version))
        ).strip(os.pathsep)
    else:
        env["PIP_USER"] = "1"
        # a distribution's Python (PEP 668 "externally managed", e.g. Debian's) refuses even
        # --user installs; these land in the user's own home and never touch system packages
        env["PIP_BREAK_SYSTEM_PACKAGES"] = "1"
    if key_file is not None:
        env[CHECKPOINT_KEY_FILE_ENV] = str(key_file)
    if user:
        env[CHECKPOINT_USER_ENV] = user
    if auto_restore:
        env[AUTO_RESTORE_ENV] = "1"
    return env


def server_args(grace_seconds: float) -> list[str]:
    """Arguments for jupyterhub-singleuser so that on stop each kernel gets `grace_seconds` to
    write its final checkpoint before it is sent SIGTERM (and as long again before SIGKILL).
    The local spawner must wait as long for the server: `interrupt_timeout` >= 2 x grace + 5."""
    return [f"--KernelManager.shutdown_wait_time={float(grace_seconds)}"]


def prepare_home(home: Path, *, python_version: tuple[int, int] | None = None) -> None:
    """Create the home's state directories (0700 where private) and the IPython profile startup
    file that loads the checkpoint extension in every Python kernel. Idempotent."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    for d in (home / ".local" / "bin", user_site(home, python_version), home / ".conda" / "envs"):
        d.mkdir(parents=True, exist_ok=True)
    gp = home / ".gpulab"
    gp.mkdir(exist_ok=True, mode=0o700)
    os.chmod(gp, 0o700)
    (gp / "checkpoints").mkdir(exist_ok=True, mode=0o700)
    startup = home / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    target = startup / STARTUP_FILE
    if not target.exists() or target.read_text() != _STARTUP_CODE:
        target.write_text(_STARTUP_CODE)
    register_env_kernels(home)


def register_env_kernels(home: Path) -> list[str]:
    """Give every conda env and venv under the home that has ipykernel a kernelspec in the home's
    Jupyter data dir, so that JupyterLab offers it (nb_conda_kernels' job, without the package).
    Returns the kernelspec names written."""
    home = Path(home)
    candidates = []
    for envs in (home / ".conda" / "envs", home / "envs", home / ".venvs"):
        if envs.is_dir():
            candidates += sorted(p for p in envs.iterdir() if p.is_dir())
    kernels = home / ".local" / "share" / "jupyter" / "kernels"
    written = []
    for env_dir in candidates:
        python = env_dir / "bin" / "python"
        if not python.exists() or not list(env_dir.glob("lib/python3*/site-packages/ipykernel")):
            continue
        name = f"gpulab-env-{env_dir.name}".lower()
        spec = {
            "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python ({env_dir.name})",
            "language": "python",
            "metadata": {"gpulab": {"env": str(env_dir)}},
        }
        (kernels / name).mkdir(parents=True, exist_ok=True)
        (kernels / name / "kernel.json").write_text(json.dumps(spec, indent=1))
        written.append(name)
    return written
