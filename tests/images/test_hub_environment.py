"""The hub image's Python environment, reproduced here: a venv of the image's Python (the same
minor version as this machine's, see images/hub/Dockerfile) from the same frozen file, installed
as the Dockerfile does (hash-checked, then gpulab's wheel from this checkout without
dependencies), and smoke-tested. The venv is kept under .venv/ (git-ignored), keyed by the
frozen file's hash, so only a changed file reinstalls it (about a minute); gpulab's wheel is
rebuilt and reinstalled every run (seconds)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.images.tools import REPO, requirements_tool

pytestmark = pytest.mark.slow

HUB = requirements_tool().IMAGES_BY_NAME["hub"]
#: the image's pip reads PyPI and nothing else: not this machine's pip config (local wheel
#: folders, version caps)
IMAGE_PIP_ENV = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}


def run(*command: str | Path, timeout: int = 600) -> str:
    result = subprocess.run(
        [str(c) for c in command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=IMAGE_PIP_ENV,
        cwd=REPO,
    )
    assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def hub_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if version != HUB.python:
        pytest.skip(f"the hub image's Python is {HUB.python}, this one {version}")
    key = hashlib.sha256(HUB.frozen.read_bytes()).hexdigest()[:16]
    venv = REPO / ".venv" / "images" / f"hub-{key}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    # one installer at a time: pytest-xdist may run this module's tests in two workers
    with open(venv.parent / f"hub-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            run(sys.executable, "-m", "venv", venv)
            run(
                venv / "bin/python",
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-cache-dir",
                "--require-hashes",
                "-r",
                HUB.frozen,
            )
            (venv / ".complete").touch()
        wheels = tmp_path_factory.mktemp("gpulab-wheel")
        run(
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            wheels,
            REPO,
        )
        (wheel,) = wheels.glob("gpulab-*.whl")
        run(
            venv / "bin/python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--force-reinstall",
            wheel,
        )
    return venv


def test_jupyterhub_runs(hub_venv: Path) -> None:
    version = run(hub_venv / "bin/jupyterhub", "--version").strip()
    pins = requirements_tool().pins(HUB.frozen)
    assert version == pins["jupyterhub"]


def test_the_hubs_config_and_the_kube_spawner_import(hub_venv: Path) -> None:
    run(
        hub_venv / "bin/python",
        "-c",
        "import gpulab.hub.config, gpulab.spawner.kube, gpulab.spawner.kube.spawner, psycopg",
    )


def test_jupyterhub_lists_gpulabs_classes(hub_venv: Path) -> None:
    # the entry points of gpulab's wheel, which the chart's config names
    out = run(hub_venv / "bin/jupyterhub", "--help-all")
    assert "GPUKubeSpawner" in out and "GPULab" in out


def test_the_environment_is_consistent(hub_venv: Path) -> None:
    run(hub_venv / "bin/python", "-m", "pip", "check")


def test_the_reproduced_environment_fits_the_hub_images_budget(hub_venv: Path) -> None:
    # measured, unlike the estimate of images/sizes.yaml: .pyc files and pip included
    sizes = yaml.safe_load((REPO / "images" / "sizes.yaml").read_text())["hub"]
    installed = sum(f.stat().st_size for f in hub_venv.rglob("*") if f.is_file())
    total = sizes["base"]["bytes"] + sizes["extra"]["bytes"] + installed
    assert total <= sizes["budget_bytes"], f"{total / 1e9:.2f} GB with the venv as installed"
