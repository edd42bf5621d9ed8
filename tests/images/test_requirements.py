"""The images' frozen requirements: complete for what gpulab declares, and they resolve for the
image's own Python and platform (uv's resolver, every file hash-checked, metadata only: torch's
wheels are never downloaded)."""

from __future__ import annotations

import sys
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.images.tools import REPO, requirements_tool

tool = requirements_tool()
IMAGES = list(tool.IMAGES_BY_NAME.values())


def declared(image) -> list[tuple[Requirement, str]]:
    """What the image's requirements.in asks for, each with the extra it comes with: its own
    lines, and the dependencies of the projects it installs from this repository, as their
    installed metadata (`.ci/dev setup` reinstalls them when pyproject.toml changes) says."""
    out = []
    for line in (image.folder / "requirements.in").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        if requirement.url is None:
            out.append((requirement, ""))
            continue
        for dependency in map(Requirement, requires(requirement.name) or []):
            out += [(dependency, extra) for extra in ("", *sorted(requirement.extras))]
    return out


def marker_environment(image, extra: str) -> dict[str, str]:
    return {
        "python_version": image.python,
        "python_full_version": f"{image.python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": extra,
    }


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_every_declared_requirement_is_pinned_within_its_range(image):
    pins = {canonicalize_name(n): v for n, v in tool.pins(image.frozen).items()}
    stale = []
    for requirement, extra in declared(image):
        if requirement.marker and not requirement.marker.evaluate(marker_environment(image, extra)):
            continue
        if not requirement.marker and extra:
            continue  # counted once, without the extra
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is None or not requirement.specifier.contains(Version(pinned), prereleases=True):
            stale.append(f"{requirement} (frozen: {pinned})")
    assert not stale, (
        f"{image.frozen.relative_to(REPO)} is out of date for {stale}: run "
        f"{Path(sys.executable).name} images/tools/requirements.py freeze {image.name}"
    )


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_the_projects_built_here_are_not_frozen(image):
    # they are installed from the repository's wheels, with --no-deps, after the frozen file
    pins = tool.pins(image.frozen)
    assert not set(image.local) & set(pins)


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_the_frozen_file_resolves_for_the_images_python_and_platform(image):
    result = tool.check(image)
    assert result.returncode == 0, result.stderr
