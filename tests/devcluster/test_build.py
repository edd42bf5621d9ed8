"""The control plane's build from Go modules (devcluster/build.py), its pure parts: the staging
replaces read from Kubernetes' own go.mod, its go and godebug lines, the version stamps. The
build itself runs on a cold machine inside the dev-cluster fixtures (every `kube` test)."""

from __future__ import annotations

import pytest

from gpulab.devcluster import build

#: the shape of k8s.io/kubernetes' go.mod as the proxy serves it (abridged)
KUBERNETES_GO_MOD = """module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
	k8s.io/api v0.0.0
	k8s.io/client-go v0.0.0
	sigs.k8s.io/yaml v1.6.0
)

replace (
	k8s.io/api => ./staging/src/k8s.io/api
	k8s.io/client-go => ./staging/src/k8s.io/client-go
	k8s.io/streaming => ./staging/src/k8s.io/streaming
)
"""


def test_each_staging_module_is_replaced_by_its_published_twin() -> None:
    assert build.staging_replaces(KUBERNETES_GO_MOD, "1.37.2") == [
        "k8s.io/api=k8s.io/api@v0.37.2",
        "k8s.io/client-go=k8s.io/client-go@v0.37.2",
        "k8s.io/streaming=k8s.io/streaming@v0.37.2",
    ]


def test_a_go_mod_without_staging_modules_is_refused() -> None:
    with pytest.raises(build.BuildError, match="no staging module"):
        build.staging_replaces("module example.com/x\n\ngo 1.26.0\n", "1.37.2")


def test_the_go_and_godebug_lines_are_copied() -> None:
    assert build.directives(KUBERNETES_GO_MOD, "go") == ["1.26.0"]
    assert build.directives(KUBERNETES_GO_MOD, "godebug") == ["default=go1.26"]


def test_both_version_packages_are_stamped() -> None:
    flags = build.version_ldflags("1.37.2", "2026-12-07T08:00:00Z").split(" -X ")
    assert flags[0] == "-s -w"
    stamps = dict(f.split("=", 1) for f in flags[1:])
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert stamps[f"{package}.gitVersion"] == "v1.37.2"
        assert stamps[f"{package}.gitMajor"] == "1"
        assert stamps[f"{package}.gitMinor"] == "37"
        assert stamps[f"{package}.gitTreeState"] == "clean"
        assert stamps[f"{package}.buildDate"] == "2026-12-07T08:00:00Z"


def test_the_cache_names_both_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPULAB_KUBE_CACHE", raising=False)
    assert build.cache_root().name == f"kubernetes-{build.KUBE_VERSION}-etcd-{build.ETCD_VERSION}"
    assert set(build.BINARIES) >= {"kube-apiserver", "etcd", "kube-proxy"}
