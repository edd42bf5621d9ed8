"""Kueue's and JobSet's builds from Go modules (devcluster/addons.py), their pure parts: the build
module, the version stamps, the caches. The builds themselves run on a cold machine inside
test_kueue.py's fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulab.devcluster import addons


def test_the_build_module_requires_the_pinned_module_and_names_its_main_package_a_tool() -> None:
    assert addons.build_go_mod(addons.KUEUE, "1.25.0") == (
        "module gpulab.invalid/kueue-build\n\n"
        "go 1.25.0\n\n"
        "tool sigs.k8s.io/kueue/cmd/kueue\n\n"
        "require sigs.k8s.io/kueue v0.17.0\n"
    )
    assert "tool sigs.k8s.io/jobset\n" in addons.build_go_mod(addons.JOBSET, "1.26.0")


def test_the_version_is_stamped_as_upstreams_makefile_does() -> None:
    flags = addons.ldflags(addons.KUEUE, "abc123", "2026-01-02T03:04:05Z")
    assert flags == (
        "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=v0.17.0"
        " -X sigs.k8s.io/kueue/pkg/version.GitCommit=abc123"
        " -X sigs.k8s.io/kueue/pkg/version.BuildDate=2026-01-02T03:04:05Z"
    )
    # JobSet's version package has no BuildDate; an unknown commit is left out
    assert addons.ldflags(addons.JOBSET, None, "x") == (
        "-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=v0.12.0"
    )


def test_each_controller_has_a_cache_of_its_own_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPULAB_KUEUE_CACHE", raising=False)
    assert addons.cache_root(addons.KUEUE) == Path.home() / ".cache/gpulab/kueue-0.17.0"
    monkeypatch.setenv("GPULAB_JOBSET_CACHE", "/tmp/js")
    assert addons.binary_path(addons.JOBSET) == Path("/tmp/js/bin/jobset-manager")


def test_the_go_line_is_read_from_the_modules_go_mod() -> None:
    assert addons.go_directive("module x\n\ngo 1.26.0\n\nrequire y v1\n") == "1.26.0"
    with pytest.raises(addons.BuildError, match="no go line"):
        addons.go_directive("module x\n")
