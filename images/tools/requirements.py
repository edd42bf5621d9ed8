"""The images' frozen Python environments: freeze them, check they resolve, estimate their size.

    .venv/bin/python images/tools/requirements.py freeze   # images/*/requirements.txt from .in
    .venv/bin/python images/tools/requirements.py check    # resolve the frozen files (tests too)
    .venv/bin/python images/tools/requirements.py sizes    # re-estimate images/sizes.yaml

A script, as helm/tools/check.py is (tests/images loads it by path). Freezing uses uv's resolver
(`uv pip compile`, the dev extra), for each image's own Python and platform. Resolving reads
package metadata only (PyPI's PEP 658 files): nothing is downloaded, not even torch's wheels.
The size estimate reads each wheel's zip directory (its uncompressed file sizes) with HTTP range
requests, and the file's size from the index; it needs PyPI and is run by hand, never by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
SIZES = IMAGES / "sizes.yaml"
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Image:
    name: str
    python: str  # the image's Python, major.minor
    platform: str  # uv's --python-platform: the image's architecture and glibc
    #: built from this repository and installed apart (--no-deps), so not frozen
    local: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return IMAGES / self.name

    @property
    def frozen(self) -> Path:
        return self.folder / "requirements.txt"


IMAGES_BY_NAME = {
    # python:3.11-slim-bookworm: Debian bookworm's glibc 2.36
    "hub": Image("hub", "3.11", "x86_64-manylinux_2_28", ("gpulab",)),
    # nvidia/cuda:*-ubuntu24.04: Ubuntu 24.04's Python 3.12 and glibc 2.39
    "singleuser": Image(
        "singleuser", "3.12", "x86_64-manylinux_2_39", ("gpulab", "jupyterlab-gpulab")
    ),
}


def uv() -> str:
    return str(VENV_BIN / "uv")


def freeze_command(image: Image) -> list[str]:
    """`uv pip compile` of the image's requirements.in (run in its folder: the .in names the
    checkout by relative path)."""
    command = [uv(), "pip", "compile", "requirements.in", "--output-file", "requirements.txt"]
    command += ["--generate-hashes", "--python-version", image.python]
    command += ["--python-platform", image.platform, "--quiet"]
    command += ["--custom-compile-command", "python images/tools/requirements.py freeze"]
    for name in image.local:
        command += ["--no-emit-package", name]
    return command


def freeze(image: Image) -> None:
    subprocess.run(freeze_command(image), cwd=image.folder, check=True)


def check_command(image: Image, target: Path) -> list[str]:
    """A full resolution of the frozen file for the image's Python and platform, every file
    hash-checked: a dependency missing from the file fails it (it has no hash), and so does a
    pin with no distribution for the image's platform. Metadata only: nothing is installed."""
    command = [uv(), "pip", "install", "--dry-run", "--require-hashes", "--python", sys.executable]
    command += ["--python-version", image.python, "--python-platform", image.platform]
    command += ["--target", str(target), "--requirement", str(image.frozen)]
    return command


def check(image: Image) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as target:
        return subprocess.run(
            check_command(image, Path(target)), capture_output=True, text=True, timeout=600
        )


def pins(frozen: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a frozen file."""
    out = {}
    for line in frozen.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#") and "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower()] = version.split()[0].rstrip("\\").strip()
    return out


# -- the size estimate (by hand: it reads PyPI) ----------------------------------------------------


def pip_report(image: Image) -> list[dict[str, Any]]:
    """What pip would install for the image's platform: one file per pin (--no-deps: the
    frozen file is complete, `check` proves it), its URL and metadata."""
    glibc_minor = int(image.platform.rsplit("_", 1)[1])
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(glibc_minor, 4, -1)]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps"]
        command += ["--ignore-installed", "--require-hashes", "--python-version", image.python]
        command += ["--implementation", "cp", "--target", f"{tmp}/target"]
        for platform in [*platforms, "manylinux2014_x86_64", "linux_x86_64"]:
            command += ["--platform", platform]
        command += ["--report", str(report), "--requirement", str(image.frozen)]
        # the machine's own pip config may cap versions (a local constraints file): not the image's
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        subprocess.run(command, check=True, env=env)
        return list(json.loads(report.read_text())["install"])


class RangeFile:
    """A remote file, read with HTTP range requests: zipfile reads a wheel's directory from it
    without downloading the wheel."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            data: bytes = response.read()
        self.pos += len(data)
        return data


def file_size(url: str) -> int:
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.headers["Content-Length"])


def installed_bytes(url: str) -> tuple[int, int]:
    """(download bytes, installed bytes) of one distribution: a wheel's files uncompressed; an
    sdist counts as its download (a few small pure-Python ones)."""
    size = file_size(url)
    if not url.endswith(".whl"):
        return size, size
    # zipfile reads the end record, then the whole directory in one read: a few requests
    with zipfile.ZipFile(RangeFile(url, size)) as wheel:  # type: ignore[arg-type]
        return size, sum(info.file_size for info in wheel.infolist())


def estimate(image: Image) -> dict[str, Any]:
    packages = {}
    download = 0
    for item in pip_report(image):
        url = item["download_info"]["url"]
        got, installed = installed_bytes(url)
        download += got
        meta = item["metadata"]
        packages[f"{meta['name'].lower()}=={meta['version']}"] = installed
        print(f"{image.name}: {url.rsplit('/', 1)[1]}: {installed / 1e6:.1f} MB", file=sys.stderr)
    return {
        "wheels_download_bytes": download,
        "installed_bytes": sum(packages.values()),
        "packages": dict(sorted(packages.items())),
    }


SIZES_HEADER = """\
# Size budget per image, and the estimate it is checked against (tests/images/test_sizes.py):
# base image + system packages + the frozen Python packages, uncompressed, in bytes.
# python_packages: what pip installs for the image's platform from its frozen requirements.txt,
# each wheel's files uncompressed as its zip directory lists them (read with HTTP range
# requests, no download; `python images/tools/requirements.py sizes` rewrites this part; the
# test fails when the frozen file and this list disagree). base and extra: figures stated by
# hand with how they were obtained; no container engine or image registry is reachable where
# this was written, so replace them with `docker image inspect` sizes once the images are built.
"""


def write_sizes(images: list[Image]) -> None:
    recorded = yaml.safe_load(SIZES.read_text())
    for image in images:
        recorded[image.name]["python_packages"] = estimate(image)
    SIZES.write_text(SIZES_HEADER + yaml.safe_dump(recorded, width=100, sort_keys=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["freeze", "check", "sizes"])
    parser.add_argument("images", nargs="*", help=f"some of {sorted(IMAGES_BY_NAME)} (all)")
    args = parser.parse_args()
    unknown = sorted(set(args.images) - set(IMAGES_BY_NAME))
    if unknown:
        parser.error(f"no image {unknown}; images: {sorted(IMAGES_BY_NAME)}")
    images = [IMAGES_BY_NAME[n] for n in args.images] or list(IMAGES_BY_NAME.values())
    if args.action == "freeze":
        for image in images:
            freeze(image)
    elif args.action == "sizes":
        write_sizes(images)
    else:
        failed = 0
        for image in images:
            result = check(image)
            print(f"{image.name}: {'resolves' if result.returncode == 0 else 'FAILS'}")
            if result.returncode:
                print(result.stderr, file=sys.stderr)
                failed = 1
        return failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
