"""Each image's size estimate (images/sizes.yaml: base image + system packages + the frozen
Python packages, uncompressed) stays under its budget, and is the estimate of the frozen file
as it is now."""

from __future__ import annotations

import re

import pytest
import yaml
from packaging.utils import canonicalize_name

from tests.images.tools import REPO, requirements_tool

tool = requirements_tool()
IMAGES = list(tool.IMAGES_BY_NAME.values())
SIZES = yaml.safe_load((REPO / "images" / "sizes.yaml").read_text())


def estimate_bytes(name: str) -> int:
    recorded = SIZES[name]
    return (
        recorded["base"]["bytes"]
        + recorded["extra"]["bytes"]
        + recorded["python_packages"]["installed_bytes"]
    )


def canonical(pins: dict[str, str]) -> set[str]:
    return {f"{canonicalize_name(n)}=={v}" for n, v in pins.items()}


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_the_estimate_is_of_the_frozen_file_as_it_is(image):
    packages = SIZES[image.name]["python_packages"]["packages"]
    recorded = canonical(dict(p.split("==", 1) for p in packages))
    assert recorded == canonical(tool.pins(image.frozen)), (
        "images/sizes.yaml estimates another frozen file: run "
        f"python images/tools/requirements.py sizes {image.name}"
    )
    assert SIZES[image.name]["python_packages"]["installed_bytes"] == sum(packages.values())


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_the_estimate_stays_under_the_budget(image):
    budget = SIZES[image.name]["budget_bytes"]
    estimate = estimate_bytes(image.name)
    assert estimate <= budget, (
        f"{image.name}: estimated {estimate / 1e9:.2f} GB, budget {budget / 1e9:.2f} GB"
    )


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_every_figure_says_how_it_was_obtained(image):
    for part in ("base", "extra"):
        assert SIZES[image.name][part]["how"].strip()
    # the base named is the Dockerfile's, its build arguments at their defaults
    dockerfile = (image.folder / "Dockerfile").read_text()
    for arg, default in re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE):
        dockerfile = dockerfile.replace(f"${{{arg}}}", default)
    bases = re.findall(r"^FROM (\S+)$", dockerfile, re.MULTILINE)
    assert SIZES[image.name]["base"]["image"] == bases[-1]
