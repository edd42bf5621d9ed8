"""Build the batch controllers the dev cluster can run beside it, Kueue and JobSet's manager, from
Go modules once; cache them.

Each is built in a build module of its own: Kueue v0.17 requires the k8s.io modules at v0.35 and
JobSet v0.12 at v0.36, neither Kubernetes 1.37's, and in one module version selection would lift
both (and their controller-runtime) to the highest of the three. Neither module has `replace`
lines, so the build module is only `require` + `tool` (`build_go_mod`, pure): version selection
gives exactly the dependency versions the project's own go.mod pins, as upstream's release build
does. Flags as upstream's Makefiles: static (`CGO_ENABLED=0`), version stamps in `-ldflags`
(`<module>/pkg/version`: the version, and the commit where the proxy tells it), plus `-trimpath
-s -w` as for the control plane.

The binaries land in `~/.cache/gpulab/<name>-<version>/bin` (`$GPULAB_<NAME>_CACHE` replaces that
folder) with a `build.log` beside them, built lazily by `ensure_binary` (never at import), in a
work folder moved in with one `rename` under a file lock: `build.locked_build` and
`build.staged_build`, which the control plane's build uses too. A module's own files (CRDs, webhook manifests) are read from Go's module cache
(`module_dir`), so applying the CRDs needs no build.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .build import (
    GO,
    BuildError,
    _run,
    download_info,
    go_environment,
    locked_build,
    staged_build,
)


@dataclass(frozen=True)
class GoController:
    """A controller built from one Go module at a pinned version."""

    name: str  # the cache's name: ~/.cache/gpulab/<name>-<version>
    module: str  # the Go module, e.g. sigs.k8s.io/kueue
    version: str  # without the v: 0.17.0
    package: str  # the main package to build
    binary: str  # the file name in bin/
    #: the package whose GitVersion/GitCommit (and BuildDate, where it has one) `-ldflags` set
    version_package: str
    stamps_build_date: bool = False

    @property
    def module_version(self) -> str:
        return f"{self.module}@v{self.version}"


KUEUE = GoController(
    name="kueue",
    module="sigs.k8s.io/kueue",
    version="0.17.0",
    package="sigs.k8s.io/kueue/cmd/kueue",
    binary="kueue",
    version_package="sigs.k8s.io/kueue/pkg/version",
    stamps_build_date=True,
)
#: the newest JobSet release the Go module proxy serves (v0.12.1 and later are refused there);
#: Kueue v0.17 itself was built against JobSet's v0.11.1 API types, whose v1alpha2 v0.12 serves
JOBSET = GoController(
    name="jobset",
    module="sigs.k8s.io/jobset",
    version="0.12.0",
    package="sigs.k8s.io/jobset",  # main.go at the module's root
    binary="jobset-manager",
    version_package="sigs.k8s.io/jobset/pkg/version",
)
CONTROLLERS = (KUEUE, JOBSET)


def cache_root(c: GoController) -> Path:
    """`$GPULAB_<NAME>_CACHE` or `~/.cache/gpulab/<name>-<version>`."""
    env = os.environ.get(f"GPULAB_{c.name.upper()}_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "gpulab" / f"{c.name}-{c.version}"


def binary_path(c: GoController) -> Path:
    return cache_root(c) / "bin" / c.binary


def cached_binary(c: GoController) -> Path | None:
    path = binary_path(c)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_go_mod(c: GoController, go_version: str) -> str:
    """The build module's go.mod (pure): requires the controller's module, names its main package
    as a tool; `go mod tidy` adds the rest from the module's own go.mod."""
    return (
        f"module gpulab.invalid/{c.name}-build\n\n"
        f"go {go_version}\n\n"
        f"tool {c.package}\n\n"
        f"require {c.module} v{c.version}\n"
    )


def ldflags(c: GoController, commit: str | None, build_date: str) -> str:
    """`-ldflags` stamping the version as upstream's Makefile does (pure)."""
    flags = ["-s", "-w", f"-X {c.version_package}.GitVersion=v{c.version}"]
    if commit:
        flags.append(f"-X {c.version_package}.GitCommit={commit}")
    if c.stamps_build_date:
        flags.append(f"-X {c.version_package}.BuildDate={build_date}")
    return " ".join(flags)


def module_info(c: GoController, cwd: Path | None = None) -> dict[str, Any]:
    """`go mod download -json` for the controller's module (`build.download_info`)."""
    folder = cwd or Path(tempfile.gettempdir())
    return download_info(c.module_version, folder, go_environment(folder), need="Dir")


def module_dir(c: GoController) -> Path:
    """The module's files (read-only, in Go's module cache)."""
    return Path(module_info(c)["Dir"])


def go_directive(go_mod: str) -> str:
    """The `go` line's version of a go.mod (pure)."""
    for line in go_mod.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "go":
            return parts[1]
    raise BuildError("the module's go.mod has no go line")


def ensure_binary(c: GoController, *, force: bool = False) -> Path:
    """The cached binary, built first if the cache lacks it (minutes, cold)."""
    return locked_build(
        cache_root(c),
        lambda: cached_binary(c),
        lambda root: _build(c, root),
        force=force,
        missing=f"the build of {c.name} finished but {binary_path(c)} is missing",
    )


def _build(c: GoController, root: Path) -> None:
    what = f"{c.name} v{c.version} ({c.package})"
    with staged_build(root, what, [c.binary]) as (work, staged, log, env):
        info = module_info(c, work)
        go_version = go_directive(Path(info["GoMod"]).read_text())
        module = work / f"{c.name}-build"
        module.mkdir()
        (module / "go.mod").write_text(build_go_mod(c, go_version))
        _run([GO, "mod", "tidy"], what=f"go mod tidy ({c.name})", log=log, cwd=module, env=env)
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        commit = (info.get("Origin") or {}).get("Hash")
        flags = ldflags(c, commit, date)
        cmd = [GO, "build", "-trimpath", "-ldflags", flags, "-o", str(staged / c.binary)]
        _run([*cmd, c.package], what=f"go build ({c.name})", log=log, cwd=module, env=env)
